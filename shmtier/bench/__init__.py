"""shmtier bench: traces, the run driver (on shmtier/connector_driver.py), the managers it
compares, reports."""
