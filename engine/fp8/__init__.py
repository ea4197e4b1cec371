"""FP8 (e4m3) at run time: the numerics (reference.py) and the Linear that runs them (linear.py)."""
