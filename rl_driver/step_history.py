"""``StepHistory``: what one step of the loop does with RHYME histories beyond its own rollout.

With ``rollout.history: per_step`` the engines hold only the current and the next step's
prompts: the driver's :class:`rl_driver.history_store.HistoryStore` keeps the rest. Each step
then (1) is planned during the step before, where its histories were imported; (2) in the
process's first step, imports its own histories up front; (3) while the trainer works, exports
its prompts' histories to the store, starts the import of the next step's into the engines
planned for them and drops the prompts the next step does not sample; (4) after the weight
sync, waits for those imports. With ``rollout.run_ahead`` idle engines draft the next step's
prompts (:class:`rl_driver.dispatch.RunAhead`), which needs that next plan too.

The loop calls, in order: :meth:`plan`, :meth:`run_ahead`, :meth:`start_transfers`,
:meth:`trained`, :meth:`wait`, :meth:`metrics`. Without either option it only plans each
step (by predicted load, as before).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from rl_driver import phases
from rl_driver.config import RunConfig
from rl_driver.dispatch import RunAhead
from rl_driver.history_store import HistoryStore
from rl_driver.steps import Step


class StepHistory:
    """The per-step history cycle of a run (module docstring)."""

    def __init__(self, config: RunConfig, pool, task: phases.Task,
                 store: Optional[HistoryStore]) -> None:
        self.config, self.pool, self.task, self.store = config, pool, task, store
        self.active = store is not None or config.rollout.run_ahead
        self.next_plan: Optional[phases.Plan] = None  # made during the step before
        self._reset(None, None, None)

    def _reset(self, step, nxt, plan) -> None:
        self.step, self.nxt, self.current = step, nxt, plan
        self.imported: List[Dict[str, Any]] = []  # the imports this step waited for
        self.exported: Optional[Dict[str, Any]] = None
        self.transfers = None

    def plan(self, step: Step, nxt: Optional[Step], affinity, first: bool) -> phases.Plan:
        """This step's plan (whole prompt groups to engines by predicted load), and the next
        step's when the cycle needs it; the process's ``first`` step imports its histories
        up front."""
        prompts = [self.task.by_id[p] for p in step.prompt_ids]
        plan = self.next_plan if self.next_plan is not None else phases.plan_epoch(
            self.config, self.pool, prompts, affinity, self.store)
        self._reset(step, nxt, plan)
        if self.store is not None and first:
            self.imported.append(
                phases.start_transfers(self.pool, self.store, plan.assignment, []).wait())
        self.next_plan = None
        if nxt is not None and self.active:
            self.next_plan = phases.plan_epoch(
                self.config, self.pool, [self.task.by_id[p] for p in nxt.prompt_ids], affinity,
                self.store)
        return plan

    def run_ahead(self) -> Optional[RunAhead]:
        """Run-ahead requests for the next step's prompts that this step does not sample."""
        step, nxt = self.step, self.nxt
        if not (self.config.rollout.run_ahead and nxt is not None and self.next_plan is not None):
            return None
        ids = {p: list(self.task.by_id[p].token_ids) for p in nxt.prompt_ids
               if p not in step.prompt_ids}
        return RunAhead(preferred=[list(e) for e in self.next_plan.assignment], prompt_ids=ids,
                        samples=self.config.rollout.run_ahead_samples, step=nxt.step,
                        seed=self.config.seed, max_new_tokens=self.config.rollout.max_new_tokens)

    def start_transfers(self, rollout: phases.Rollout) -> None:
        """While the trainer works: the step's histories (and the run-ahead prompts', from the
        engines that drafted them) to the store; the next step's into their engines; the
        step's prompts the next step does not sample out of every engine."""
        if self.store is None:
            return
        where = {pid: [e] for e, ids in enumerate(self.current.assignment) for pid in ids}
        for pid, e in (rollout.run_ahead or {}).get("claimed", {}).items():
            if e not in where.setdefault(pid, []):
                where[pid].append(e)
        self.exported = phases.export_histories(self.pool, self.store, where)
        nxt = self.nxt
        self.transfers = phases.start_transfers(
            self.pool, self.store, self.next_plan.assignment if self.next_plan else [],
            [p for p in self.step.prompt_ids if nxt is None or p not in nxt.prompt_ids])

    def trained(self, train: Dict[str, Any]) -> None:
        """The export's part past the training is on the critical path."""
        if self.exported is not None:
            self.exported["critical_s"] = max(
                0.0, self.exported["seconds"] - float(train["train_time_s"]))

    def wait(self) -> None:
        """After the weight sync: the next step's imports and this step's drops."""
        if self.transfers is not None:
            self.imported.append(self.transfers.wait())

    def metrics(self, rollout: phases.Rollout, rhyme_stats: List[Dict[str, Any]]) -> Dict[str, Any]:
        """The step's transfer and run-ahead figures, and what each engine holds at its end
        (empty when the cycle is off)."""
        if not self.active:
            return {}
        out = transfer_keys(self.imported, self.exported, rollout.run_ahead,
                            self.config.rollout.run_ahead)
        out["history_num_prompts"] = [st.get("num_prompts") for st in rhyme_stats]
        out["run_ahead_records"] = [st.get("run_ahead_records") for st in rhyme_stats]
        out["history_residue_tokens"] = [st.get("dropped_global_tokens") for st in rhyme_stats]
        return out


def transfer_keys(imported: List[Dict[str, Any]], exported: Optional[Dict[str, Any]],
                  run_ahead: Optional[Dict[str, Any]], run_ahead_on: bool) -> Dict[str, Any]:
    """The history transfers of the step's loop pass: the export of its prompts, the import
    of the next step's (and, in a process's first step, of its own, up front); seconds, bytes
    and the part on the critical path (the export's time past the training, every wait for
    an import); and its run-ahead figures."""
    out: Dict[str, Any] = {}
    if exported is not None:
        dropped = imported[-1]["num_prompts"]
        out.update(history_import_s=sum(i["seconds"] for i in imported),
                   history_import_bytes=sum(i["bytes"] for i in imported),
                   history_export_s=exported["seconds"], history_export_bytes=exported["bytes"],
                   history_exported_prompts=exported["prompts"],
                   history_store_write_bytes=exported["store_bytes"],
                   history_drop_busy=sum(i["busy"] for i in imported),
                   history_transfer_critical_s=exported["critical_s"]
                   + sum(i["waited_s"] for i in imported),
                   history_num_prompts_after_drop=[dropped.get(e) for e in sorted(dropped)])
    if run_ahead_on:  # zeros in a step without a next one
        out.update({k: 0 for k in ("run_ahead_requests", "run_ahead_tokens", "run_ahead_prompts",
                                   "run_ahead_aborted")},
                   run_ahead_abort_s=0.0, run_ahead_drain_s=0.0)
        out.update({k: v for k, v in (run_ahead or {}).items() if k != "claimed"})
    return out
