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
export MPISHARD_MPIRUN_FLAGS=${MPISHARD_MPIRUN_FLAGS:---oversubscribe}
