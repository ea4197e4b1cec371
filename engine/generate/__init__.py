"""Generation: packing requests into varlen batches, the decoding math, and the step loop with CUDA graphs."""
