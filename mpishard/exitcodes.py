"""Exit codes of mpishard processes that a launcher or batch script acts on. Pure."""

from __future__ import annotations

__all__ = ["EXIT_STOPPED", "EXIT_USAGE", "STOP_NOTE"]

#: Bad input: every rank returns it, rank 0 prints one line.
EXIT_USAGE = 2

#: Stopped on request (SIGUSR1 for a planned resize, SIGTERM before a Slurm time
#: limit or preemption) after writing a checkpoint: relaunch or requeue and the job
#: resumes from there. 75 is EX_TEMPFAIL of sysexits.h, "try again later". The
#: elastic agent (``mpishard run``) relaunches workers that exit with it.
EXIT_STOPPED = 75

#: The note a worker job leaves in its launch folder (``MPISHARD_JOB_DIR``) when
#: training stopped for a signal and checkpointed (JSON: ``reason``, ``signal``,
#: ``step``, ``checkpoint``, ``exit_code``); removed when training goes on. The
#: elastic agent reads it when the workers exit 0 after it asked them to stop: a
#: worker script that ignores ``ElasticOptimizer.exit_code`` then did not finish.
STOP_NOTE = "stopped.json"
