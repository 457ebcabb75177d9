"""Draft sources compared by the replay benchmark (ours and re-implemented or wrapped peers)."""
