#!/usr/bin/env bash
# Prepare .gpu/ (git-ignored) for the GPU checks (bench/gpu_run.sh) on a machine that has
# python3.12 with torch and transformers but no package index: wheels of the trainer SDK's
# import chain that such an image lacks (same versions as .venv), this machine's
# redis-server with the libraries it links beyond glibc, and the run script.
#   bash bench/gpu_setup.sh        # then carry .gpu/ along and run: bash .gpu/run.sh
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=.gpu
rm -rf "$out" && mkdir -p "$out/whl" "$out/redis/lib" "$out/bin"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
for package in redis hiredis PyJWT orjson pydantic pydantic_core annotated-types \
               typing-inspection structlog typing_extensions; do
  version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('$package'))")
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$out/whl" "$package==$version"
done
server=$(command -v redis-server)
cp "$server" "$out/redis/"
ldd "$server" | awk '/=> \// {print $3}' | grep -vE '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so' \
  | xargs -r -I{} cp -L {} "$out/redis/lib/"
cat >"$out/bin/redis-server" <<'WRAP'
#!/bin/sh
# redis-server with the libraries it was built against; only this process sees them.
here=$(dirname "$(readlink -f "$0")")/../redis
LD_LIBRARY_PATH="$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" exec "$here/redis-server" "$@"
WRAP
chmod +x "$out/bin/redis-server"
cp bench/gpu_run.sh "$out/run.sh"
du -sh "$out"
