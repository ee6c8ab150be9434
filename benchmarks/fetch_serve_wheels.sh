#!/usr/bin/env bash
# Wheels that ssmq serve and its tests need on the GPU machine, whose image lacks them (it has httpx, h11, click,
# anyio, prometheus-client, tqdm): into .whl/ (git-ignored), for Python 3.12 on x86-64. Run here, online to a
# package index; then run(carry=[".whl"], command="bash benchmarks/device_serve.sh").
set -euo pipefail
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic-core==2.46.4 \
  annotated-types==0.7.0 annotated-doc==0.0.7 typing-inspection==0.4.2 typing-extensions==4.16.0 \
  opentelemetry-api==1.45.2 anyio==4.16.0 openai==3.54.0 distro==1.9.0 jiter==0.19.0 sniffio==1.3.1 \
  httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
ls .whl
