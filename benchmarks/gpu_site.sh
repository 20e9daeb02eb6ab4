#!/usr/bin/env bash
# Packs what `python -m rl.train` needs beyond the GPU image (torch, triton, transformers, numpy,
# pyarrow, matplotlib are there; ray, wandb, omegaconf, verl and their small dependencies are not)
# into .gpu/site.tar.xz for a machine that reaches no package index. Ray's wheel (~79 MB) is over
# the 64 MiB that travels with a device call, so the wheels are unpacked, Ray's Java jars, RLlib,
# Serve, Tune, Train and the dashboard's source maps dropped, the large binaries stripped of symbols
# and the tree recompressed with xz: ~37 MB. On the GPU machine (carry .gpu):
#   mkdir -p /tmp/site && tar -C /tmp/site -xJf .gpu/site.tar.xz && export PYTHONPATH=/tmp/site:$PWD
# Usage here: bash benchmarks/gpu_site.sh [PYTHON_VERSION=3.12]
set -euo pipefail
cd "$(dirname "$0")/.."
PYV="${1:-3.12}"
WHEELS=(ray==2.60.0 wandb==0.31.0 omegaconf==2.4.0 antlr4-python3-runtime==4.13.2 verl==0.9.1
  jsonschema jsonschema-specifications referencing rpds-py cwevals==0.0.1b1 distro sniffio
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-exporter-otlp-proto-http==1.45.2 opentelemetry-exporter-otlp-proto-common==1.45.2
  opentelemetry-exporter-http-transport==0.66b2 opentelemetry-exporter-otlp-common==0.66b2
  opentelemetry-semantic-conventions==0.66b2 googleapis-common-protos platformdirs
  pydantic pydantic-core annotated-types typing-inspection)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$work/wheels" "${WHEELS[@]}"
mkdir "$work/site"
for w in "$work"/wheels/*.whl; do unzip -q -o "$w" -d "$work/site"; done
rm -rf "$work"/site/ray/{jars,rllib,serve,tune,train} "$work"/site/ray/dashboard/client/build/static/js/*.map
find "$work/site" \( -name '*.so' -o -path '*/ray/core/src/ray/*' \) -type f -size +1M \
  -exec strip --strip-unneeded {} + 2>/dev/null || true
mkdir -p .gpu
tar -C "$work/site" -cf - . | xz -T2 -9e > .gpu/site.tar.xz
ls -la .gpu/site.tar.xz
