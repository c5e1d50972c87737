#!/usr/bin/env bash
# Wheels for the server and W&B on the GPU machines (python 3.12, no package registry there): into
# .whl_server/ (ignored by git), which gpu_session.sh installs beside .whl/. Run here, where PyPI is
# reachable; carry .whl_server in a call of its own (~25 MB).
set -euo pipefail
rm -rf .whl_server && mkdir -p .whl_server
python3 -m pip download -q --only-binary=:all: --no-deps --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 --python-version 3.12 --implementation cp -d .whl_server \
  fastapi==0.115.12 starlette==0.46.2 uvicorn pydantic pydantic-core annotated-types typing-inspection anyio sniffio h11 \
  click pyzmq wandb==0.21.4 "protobuf>=6,<7" sentry-sdk platformdirs gitpython gitdb smmap
du -sh .whl_server && ls .whl_server
