# Sourced by gpu_check.sh and gpu_profile.sh on a GPU machine: finds the Python that holds PyTorch
# (PY) and puts its pip CUDA libraries (site-packages/nvidia/*/lib), then the CUDA toolkit's, on
# LD_LIBRARY_PATH, with libnccl.so.2 linked as libnccl.so (the name cudarc opens).

# The lent machines keep PyTorch in a venv.
if [ -z "${PYTHON:-}" ] && [ -x /opt/torch/.venv/bin/python3 ]; then
  PYTHON=/opt/torch/.venv/bin/python3
fi
PY=${PYTHON:-python3}
lib_dirs=$("$PY" - <<'PYEOF' 2>/dev/null
import glob, importlib.util, os
spec = importlib.util.find_spec("nvidia")
dirs = set()
for base in (spec.submodule_search_locations if spec else []):
    for f in glob.glob(os.path.join(base, "**", "lib", "lib*.so*"), recursive=True):
        dirs.add(os.path.dirname(f))
print(":".join(sorted(dirs)))
PYEOF
)
if [ -z "$lib_dirs" ]; then
  echo "$(basename "$0"): $PY has no nvidia-* pip libraries; relying on the system's (set PYTHON" >&2
  echo "to the Python that holds PyTorch to use its CUDA libraries)" >&2
fi
links=$(mktemp -d)
for d in ${lib_dirs//:/ }; do
  [ -e "$d/libnccl.so.2" ] && ln -sf "$d/libnccl.so.2" "$links/libnccl.so"
done
toolkit=""
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && toolkit="$toolkit:$d"
done
export LD_LIBRARY_PATH="${links}:${lib_dirs}${toolkit}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
