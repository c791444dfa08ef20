"""What runs compiled programs: the MindSpore child processes (their protocol, the worker and its tasks), the
streamed MindIR writer, the block-by-block run and the greedy generation loop. The compiler (graphconv/target)
writes programs; this package runs them, and imports the compiler, never the other way round."""
