"""rl_driver: the Ray RL driver around rhyme-sglang engines.

- ``rollout``: ``RolloutActor`` (one engine per Ray actor, the RL-framework method set);
  ``http_client``: the same methods against a running server; ``hooks``: glue for
  OpenRLHF / verl / slime.
- ``trainer``: the GRPO ``Trainer`` actor; ``grpo``: the GRPO math (no Ray, no sglang).
- ``weight_sync``: trainer -> engines by tensors, process group or disk.
- ``balance`` + ``dispatch``: length-balanced group assignment, lossless migration of
  overrunning requests, restart of dead engines; ``pool``: the engine actors.
- ``loop``: the epoch loop; ``cli`` (``rhyme-rl train``), ``demo`` (``make demo``),
  ``report`` (plots + report.md); ``config``: frozen, validated run configuration.
"""
