#!/usr/bin/env bash
# Build the zenserve CPU images from docker/Dockerfile.cpu, tagged by commit and never pushed:
#   <registry>/<repo>:<commit>-cpu       --target zenserve-openai (the serving image)
#   <registry>/<repo>:<commit>-cpu-test  --target zenserve-test   (CI runs the suite in it)
# Images are rebuilt from source on every run; a warm layer cache makes a rebuild cheap.
set -euo pipefail

if [[ $# -lt 3 ]]; then
  echo "Usage: $0 <registry> <repo> <commit>" >&2
  exit 1
fi

registry=$1
repo=$2
commit=$3

cd "$(dirname "$0")/.."

build_target() {  # <target> <tag>
  echo "--- :docker: Building $1 as $2"
  docker build --file docker/Dockerfile.cpu \
    --platform linux/amd64 \
    --build-arg GIT_COMMIT="$commit" \
    --target "$1" \
    --tag "$2" \
    --progress plain \
    .
}

build_target zenserve-openai "$registry/$repo:$commit-cpu"
build_target zenserve-test "$registry/$repo:$commit-cpu-test"
