"""Serving placement (AlpaServe): workloads, a discrete-event simulator, parallel
configurations from the compiler, and the placement search."""
