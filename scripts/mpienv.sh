# Sourced by the scripts: the mpirun flags this machine needs.
# As root, Open MPI refuses to start without these two variables.
if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# More ranks than cores: let waiting ranks yield the core instead of spinning.
export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}
# Containers and laptops have no high-speed network: keep Open MPI quiet about it.
# (Leave vader's single-copy mechanism at its default, CMA: measured here, turning
# it off made a 7 MiB Allreduce between 2 ranks 5x slower.)
export OMPI_MCA_btl=${OMPI_MCA_btl:-self,vader,tcp}
# Open MPI 4's PMIx signs each job's credentials with munge where libmunge is
# installed (Slurm's packages bring it): with munged not running, every mpirun and
# every singleton MPI_Init retries the socket for about 2.1 s before falling back
# (measured here: `mpirun -n 1 true` 2.5 s, 0.2 s with this). The job's processes
# all run on machines of this job's launcher, so its own "native" credentials do.
export PMIX_MCA_psec=${PMIX_MCA_psec:-^munge}
export MPISHARD_MPIRUN_FLAGS=${MPISHARD_MPIRUN_FLAGS:---oversubscribe}
