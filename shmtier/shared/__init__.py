"""Building blocks mapped by every shmtier process: the segment and its areas.

Imported by the scheduler, GPU workers and tier workers alike, so nothing here
imports torch or vLLM.
"""
