"""Lock-free SPSC ring buffer in shared memory with an eventfd event flag (the FMQ analogue). Imports nothing of nnrt."""
