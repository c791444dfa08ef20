"""The MindSpore target: the targets, the lowering (opmap handlers through the node context
into the emission IR), code generation with repeated layers, and the MindSpore child
processes that export and run the generated network."""
