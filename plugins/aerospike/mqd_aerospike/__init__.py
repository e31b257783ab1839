"""Aerospike storage for mqd: each queue a chain of buffer records behind a metadata record."""
