# OVBatch image for the Ray head and the GPU workers (docker-compose.yml).
# The base brings CUDA, cuDNN and a CUDA build of torch; ovbatch and Ray go on top.
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-devel
FROM ${BASE_IMAGE}

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    OVBATCH_CACHE=/data/cache

RUN apt-get update \
 && apt-get install -y --no-install-recommends libsndfile1 espeak-ng \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/ovbatch
COPY pyproject.toml README.md ./
COPY engine engine
COPY pipeline pipeline
COPY csrc csrc
COPY jobs jobs
COPY tests/data tests/data
# ray[default] brings the dashboard and the job server that `ray job submit` talks to; ninja is what
# torch.utils.cpp_extension builds the W4A4 kernels (csrc/) with on a worker's first use.
RUN pip install -e . "ray[default]" ninja \
 && python -c "import engine, pipeline, ray; print('ovbatch image ready, ray', ray.__version__)"

VOLUME ["/data"]
