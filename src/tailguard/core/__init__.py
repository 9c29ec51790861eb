"""The sans-IO decision core: no sockets, no clocks, no global randomness."""
