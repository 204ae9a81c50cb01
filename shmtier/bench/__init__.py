"""shmtier bench: traces, the connector-sequence driver, the managers it compares, reports."""
