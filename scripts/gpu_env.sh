# Sourced by the scripts/gpu_*.sh checks on a lent GPU machine: $OUT (default ./gpu-out), the carried
# wheels (.whl, see ../shared/device/wheels.sh) on PYTHONPATH, unbuffered Python.
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
