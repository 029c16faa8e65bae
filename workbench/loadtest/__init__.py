"""Tools that drive and watch a running server from outside, as an operator would: the load
generator (loadgen.py), the soak test (soak.py), a real Prometheus over its scrapes (prometheus.py)
and deploy/'s dashboard panels asked of it (dashboard.py)."""
