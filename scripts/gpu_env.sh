# Sourced by the scripts/gpu_*.sh checks on a lent GPU machine: $OUT (default ./gpu-out), the carried
# wheels (.whl, see ../shared/device/wheels.sh) on PYTHONPATH, unbuffered Python.
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1

# The GPU, the host CPU, torch and Triton: printed, and kept in $OUT/machine.txt.
record_machine() {
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; lscpu | grep -m1 'Model name';
    python3 -c 'import torch; print("torch", torch.__version__)
try:
    import triton; print("triton", triton.__version__)
except ImportError:
    print("triton: none")'; } > "$OUT/machine.txt" 2>&1
  cat "$OUT/machine.txt"
}
