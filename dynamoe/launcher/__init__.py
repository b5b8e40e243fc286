"""Process launchers: ``python -m dynamoe.launcher.run`` bridges MPI launches to torch.distributed."""
