"""Discrete-event simulator: workload generators, event loop, faults and reports."""
