"""Control commands of the RHYME worker (the ``rhyme_*`` Engine calls and ``/rhyme/*`` routes).

Snapshot paths arrive here as given: the HTTP layer confines them to the snapshot directory
(:mod:`.snapshot_paths`); the in-process ``Engine`` API is trusted like any Python caller.

:class:`ControlCommands` is mixed into :class:`~rhyme_sglang.sglang_ext.worker.RhymeWorker`;
``command(name, args)`` runs ``_cmd_<name>(**args)`` under the worker's lock, called from the
control thread (:mod:`.control`). A handler raises ``ValueError`` naming the bad value and leaves
the history unchanged; its result is JSON-serialisable.
"""

from __future__ import annotations

import dataclasses
import math

from rhyme_sglang.core import DraftStore
from rhyme_sglang.core.store import check_prompt_ids
from rhyme_sglang.sglang_ext import timeline
from rhyme_sglang.sglang_ext.stats import SpecStats


class ControlCommands:
    """Handlers over the worker's ``store``, ``stats``, ``cost``, ``config``, ``lock``,
    ``requests`` (requests in flight) and ``scheduling``."""

    def command(self, name: str, args: dict):
        """Run one control command under the lock (see :mod:`.control`)."""
        with self.lock:
            self._maybe_advance_epoch()
            handler = getattr(self, "_cmd_" + name, None)
            if handler is None:
                raise ValueError(f"unknown rhyme command {name!r}")
            return handler(**args)

    def _cmd_stats(self):
        out = self.stats.as_dict()
        cost_model = self.cost.as_dict()
        cost_model["seeded_cells"] = self.step_costs.seeded if self.step_costs else 0
        cost_model["rested_steps"] = self.rest.rested  # plain steps that skipped drafting
        cost_model["probe_every"] = self.cost.probe_every
        out.update(
            cost_model=cost_model, breakdown=timeline.breakdown(),
            epoch=self.store.epoch, num_prompts=self.store.num_prompts,
            num_responses=self.store.num_responses, run_ahead_records=self.store.num_run_ahead,
            dropped_global_tokens=self.store.residue_tokens,
            active_requests=len(self.requests),
            memory_bytes=self.store.estimate_memory(), backend=self.store.backend,
            speculation_health=self.health.report(self.cost.calibration_at_bound()),
        )
        return out

    def _cmd_flush_step_costs(self):
        """Save the cost model's step costs now (the engine calls it when it shuts down)."""
        if self.step_costs is None:
            return {"saved": False}
        self.step_costs.flush(self.cost)
        return {"saved": True}

    def _cmd_breakdown(self, reset=False):
        return timeline.breakdown(reset=bool(reset))

    def _cmd_set_rewards(self, rewards):
        if not isinstance(rewards, list) or not rewards:
            raise ValueError("rewards must be a non-empty list of objects")
        targets = []
        for item in rewards:
            if not isinstance(item, dict):
                raise ValueError(f"each reward must be an object, got {item!r}")
            reward = item.get("reward")
            if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
                raise ValueError(f"reward must be a finite number, got {reward!r}")
            if "rid" in item:
                target = item["rid"]
                if not isinstance(target, str):
                    raise ValueError(f"rid must be a string, got {target!r}")
            elif "prompt_id" in item and "sample" in item:
                if not isinstance(item["sample"], int) or isinstance(item["sample"], bool):
                    raise ValueError(f"sample must be an int, got {item['sample']!r}")
                target = (str(item["prompt_id"]), item["sample"])
            else:
                raise ValueError(f"a reward needs 'rid' or 'prompt_id'+'sample': {item!r}")
            targets.append((target, float(reward)))
        unknown = [t for t, _ in targets if not self.store.has_reward_target(t)]
        if unknown:  # all-or-nothing: nothing is applied when any target is unknown
            raise ValueError(f"unknown reward target(s): {unknown[:5]}")
        for target, reward in targets:
            self.store.set_reward(target, reward)
        return {"updated": len(targets)}

    def _cmd_advance_epoch(self):
        return {"epoch": self.advance_epoch()}

    def _cmd_save(self, path):
        self.store.save(str(path))
        return {"path": str(path), "num_responses": self.store.num_responses}

    def _cmd_load(self, path):
        if len(self.requests):
            raise ValueError("cannot load a snapshot while requests are running")
        self.store.load(str(path))
        self.cost.forget_acceptance()
        return {"epoch": self.store.epoch, "num_responses": self.store.num_responses}

    def _cmd_export_history(self, prompt_id):
        """One prompt's history (``DraftStore.export_prompt``), for another engine's import."""
        return self.store.export_prompt(prompt_id)

    def _cmd_export_histories(self, prompt_ids):
        """The histories of ``prompt_ids`` (``DraftStore.export_prompt`` each, in their
        order); prompts the store lacks are omitted."""
        check_prompt_ids(prompt_ids)
        return [self.store.export_prompt(k) for k in dict.fromkeys(prompt_ids)
                if self.store.has_prompt(k)]

    def _cmd_drop_history(self, prompt_ids):
        """Remove these prompts' whole history -> ``{"dropped", "busy", "num_prompts",
        "memory_bytes"}``; unknown ids are ignored, prompts with a request in flight are kept
        and listed in ``busy``."""
        check_prompt_ids(prompt_ids)
        busy = self.store.prompts_in_flight(prompt_ids)
        dropped = self.store.drop_prompts(prompt_ids)
        return {"dropped": dropped, "busy": busy, "num_prompts": self.store.num_prompts,
                "memory_bytes": self.store.estimate_memory()}

    def _cmd_import_history(self, history, replace=False):
        if not isinstance(replace, bool):
            raise ValueError(f"replace must be a boolean, got {replace!r}")
        added = self.store.import_prompt(history, replace=replace)
        return {"added": added, "num_responses": self.store.num_responses}

    def _cmd_reset(self):
        if len(self.requests):
            raise ValueError("cannot reset while requests are running")
        self.store = DraftStore(self.config.store_config())
        self.stats = SpecStats()
        self.requests.store = self.scheduling.store = self.store
        self.requests.stats = self.scheduling.stats = self.stats
        return {"epoch": 0}

    def _cmd_draft(self, prompt, context=(), max_tokens=8, prompt_id=None):
        """The draft the store would propose after ``prompt + context`` (for inspection)."""
        rid = "__rhyme_probe__"
        self.store.start_request(rid, list(prompt), prompt_id=prompt_id)
        try:
            if context:
                self.store.add_tokens(rid, list(context))
            draft = self.store.speculate(rid, int(max_tokens))
        finally:
            self.store.finish_request(rid, add_to_history=False)
        return {"token_ids": list(draft.token_ids), "parents": list(draft.parents),
                "probs": [float(p) for p in draft.probs], "match_len": draft.match_len}

    def _cmd_schedule_policy(self, policy=None):
        """Return the waiting-queue policy; switch it first when ``policy`` is given."""
        if policy is not None:
            # RhymeConfig validates the name (ValueError lists the choices)
            self.config = dataclasses.replace(self.config, schedule_policy=policy)
            self.scheduling.config = self.config
        return {"policy": self.config.schedule_policy}

    def _cmd_predict_lengths(self, prompts):
        if not isinstance(prompts, list):
            raise ValueError("prompts must be a list of token-id lists or prompt ids")
        out = []
        for p in prompts:
            if isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)):
                out.append(float(self.store.predict_length(p)))
            else:
                raise ValueError(f"a prompt must be a prompt id or a list of token ids, got {p!r}")
        return {"lengths": out}
