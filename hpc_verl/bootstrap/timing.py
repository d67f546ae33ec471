"""How often the node supervisor and the watcher look, and the bound the job script derives from
them. Constants only: the renderer imports this (the bound is rendered into the script) without
importing the supervisor."""
from __future__ import annotations

#: how often the supervisor looks at its raylet while the job runs
SUPERVISOR_POLL_S = 0.25
#: a multi-threaded raylet shows as a zombie before its last threads are gone; its exit status
#: (how it ended, for the diagnosis) can take this long to reap
RAYLET_REAP_S = 2.0
#: how often ``hpc_verl.bootstrap watch`` reads the nodes' states
WATCH_POLL_S = 0.25
#: bound from a node's raylet dying to the watcher reporting it (polls, reap, a state write): a
#: trainer that failed because its Ray went away can end before that, and the job script waits
#: this long for the node's diagnosis before it blames the trainer (rendered into the script)
FAILURE_REPORT_S = SUPERVISOR_POLL_S + RAYLET_REAP_S + WATCH_POLL_S + 1.0
#: a worker waiting for the head probes the head's published GCS port this often, each probe
#: bounded by REACH_PROBE_S; a port that has not answered for REACH_GRACE_S is reported (the
#: head publishes its address only once its GCS listens, so silence is the network between them)
REACH_EVERY_S = 2.0
REACH_PROBE_S = 1.0
REACH_GRACE_S = 3.0
