"""Tier worker processes: the job loop and the external pool launcher (``shmtier workers``)."""
