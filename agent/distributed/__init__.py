"""mechwatch in a distributed job: one agent per rank, one decision for the whole job.

Create one ``Agent(model, optimizer, ...)`` per rank after
``torch.distributed.init_process_group`` (torchrun, DDP or FSDP2): the agent reads the rank
and the world size from torch.distributed (``world.World``) and then:

- every rank feeds its rules the same samples at the same step (``measurements``,
  ``exchange``): the losses, grad norms and router sums are gathered and reduced over the
  ranks at each read-out step (one small collective; none on the other steps, none on the
  monitor thread), and the QK spectra, each measured by one rank, are gathered at the step
  they are applied at, so alerts, incidents, actions and their steps are identical everywhere
  and every rank runs the same actions at the same step boundary;
- the QK monitor work is spread over the ranks (``assignment``: heads round robin, control
  matrices and router weight statistics by layer), and of a sharded weight (FSDP2) a rank
  fetches only the rows of its heads (``fetch``, ``snapshots``); with tensor-parallel heads
  (or FSDP2 shards on head boundaries) each rank measures its local heads;
- rollback checkpoints are written with torch.distributed.checkpoint and count only once every
  rank's files and the metadata are committed (``checkpoints``);
- rank 0 pages (the page names the ranks involved); every rank writes its own event log; the
  watchdog names a rank that stops stepping (``watchdog``).

``wiring`` picks the one-process or the distributed part of each of these.
"""

from agent.distributed.world import RankFailure, World

__all__ = ["RankFailure", "World"]
