"""W4A4 at run time: the checkpoint format, the reference numerics and the Linear that runs them."""
