"""tools/extend_context.py with FA4SparseStepKernel.capture = True (FA4 sparse steps captured in CUDA graphs)."""
import os, runpy, sys
sys.path.insert(0, os.path.join(os.getcwd(), "tools"))
import megatron_mtraining.ops.fa4 as f
f.FA4SparseStepKernel.capture = True
sys.argv = ["tools/extend_context.py"] + sys.argv[1:]
runpy.run_path("tools/extend_context.py", run_name="__main__")
