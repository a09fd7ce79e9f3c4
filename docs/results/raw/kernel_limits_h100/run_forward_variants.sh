# From the repository root: python docs/results/raw/kernel_limits_h100/forward_variants.py /tmp/fv, then this script.
# Each variant in its own process (base = the repository's kernels, run first and last).
R=$PWD
for v in base v1_fma v2_lazy v3_lazy_nobranch base; do
  if [ $v = base ]; then p=$R; else p=/tmp/fv/$v; fi
  (cd $p && VARIANT=$v PYTHONPATH=$p python $R/docs/results/raw/kernel_limits_h100/forward_check.py)
done
