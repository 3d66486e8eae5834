#!/usr/bin/env bash
# Build the zenserve Zen (zentorch) test image as two layered builds, tagged by commit and never pushed:
#   1. <registry>/<repo>:<commit>-cpu           docker/Dockerfile.cpu --target zenserve-openai (the base)
#   2. <registry>/<repo>:<commit>-zen-cpu-test  docker/Dockerfile.zen --target zenserve-zen-test on top
# Images are rebuilt from source on every run; a warm layer cache makes a rebuild cheap.
set -euo pipefail

if [[ $# -lt 3 ]]; then
  echo "Usage: $0 <registry> <repo> <commit>" >&2
  echo "  env ZENTORCH_VERSION=<version> pins zentorch (default: the zen extra of pyproject.toml)" >&2
  exit 1
fi

registry=$1
repo=$2
commit=$3
base_image="$registry/$repo:$commit-cpu"
zen_image="$registry/$repo:$commit-zen-cpu-test"

# Passed only when set and non-empty; otherwise Dockerfile.zen installs the zen extra.
zentorch_args=()
if [[ -n ${ZENTORCH_VERSION:-} ]]; then
  zentorch_args=(--build-arg "ZENTORCH_VERSION=$ZENTORCH_VERSION")
fi

cd "$(dirname "$0")/.."

echo "--- :docker: Building the CPU base $base_image"
docker build --file docker/Dockerfile.cpu \
  --platform linux/amd64 \
  --build-arg GIT_COMMIT="$commit" \
  --target zenserve-openai \
  --tag "$base_image" \
  --progress plain \
  .

echo "--- :docker: Building the Zen test image $zen_image"
docker build --file docker/Dockerfile.zen \
  --platform linux/amd64 \
  --build-arg BASE_IMAGE="$base_image" \
  --build-arg GIT_COMMIT="$commit" \
  "${zentorch_args[@]}" \
  --target zenserve-zen-test \
  --tag "$zen_image" \
  --progress plain \
  .
