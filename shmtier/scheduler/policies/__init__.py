"""Eviction policies of the CPU primary tier (built-in: ``lru``, ``arc``)."""

from shmtier.scheduler.policies.base import CachePolicy, ChunkStatus, SegmentBackedPolicy
from shmtier.scheduler.policies.factory import CachePolicyFactory

__all__ = ["CachePolicy", "CachePolicyFactory", "ChunkStatus", "SegmentBackedPolicy"]
