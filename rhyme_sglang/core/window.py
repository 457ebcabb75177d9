"""Per-request draft window that adapts to acceptance, TCP style."""

from __future__ import annotations

from .config import WindowConfig


class SpecWindow:
    """Upper bound on the number of draft tokens proposed for one request.

    Rule (constants from `WindowConfig`, defaults in brackets):
      - start at `initial` [16];
      - full acceptance (every proposed token accepted, at least one proposed): double the window,
        capped at `maximum` [32] (slow-start growth: a run of agreement ramps up quickly);
      - partial or no acceptance: multiply by `decrease` [0.5] (multiplicative back-off) but never
        below `accepted + 1` (the next draft may still reach one past what just agreed) and never
        below `minimum` [16];
      - nothing proposed: unchanged.
    The caller's budget (`max_tokens`) bounds the draft further. With the default floor of 16 the
    window never binds at budgets k <= 16 (replay of the dev trace at k=16: a floor of 8 cost
    tau 4.37 -> 4.20 for 7% less waste; an engine verifies a fixed-size tree anyway, so unused
    slots save nothing there); it trims long drafts (k > 16) after rejections.
    """

    __slots__ = ("config", "size")

    def __init__(self, config: WindowConfig) -> None:
        self.config = config
        self.size = config.initial

    def update(self, num_proposed: int, num_accepted: int) -> int:
        if num_proposed < 0 or num_accepted < 0:
            raise ValueError(f"counts must be >= 0, got proposed={num_proposed}, accepted={num_accepted}")
        if num_accepted > num_proposed:
            raise ValueError(f"num_accepted={num_accepted} exceeds num_proposed={num_proposed}")
        cfg = self.config
        if num_proposed == 0:
            return self.size
        if num_accepted == num_proposed:
            self.size = min(cfg.maximum, self.size * 2)
        else:
            shrunk = int(self.size * cfg.decrease)
            self.size = max(cfg.minimum, num_accepted + 1, shrunk)
            self.size = min(self.size, cfg.maximum)
        return self.size
