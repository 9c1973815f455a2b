# One image for every ktserve service: `ktserve serve` (the GPU service) and `ktserve expert`.
#
#   docker build -t ktserve .                       torch from the default index (with CUDA)
#   docker build --build-arg TORCH_SPEC=torch==2.13.0+cpu -t ktserve .
#                                                   a CPU-only torch wheel put in .whl/ first
#
# BASE_IMAGE: any Debian-based image with Python >= 3.11, its headers and venv (the official
# python:3.11-slim has them). Wheels in .whl/ (ignored by git) are preferred over downloads.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ make \
 && rm -rf /var/lib/apt/lists/*
ARG TORCH_SPEC=torch>=2.4,<2.14
ARG PIP_ARGS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY . /src
WORKDIR /src
# NOTE: torch first, so that the project's own range cannot swap it for another build.
RUN python3 -m venv /opt/ktserve \
 && /opt/ktserve/bin/pip install --find-links /src/.whl ${PIP_ARGS} "${TORCH_SPEC}" \
 && /opt/ktserve/bin/pip install --find-links /src/.whl ${PIP_ARGS} /src

FROM ${BASE_IMAGE}
COPY --from=build /opt/ktserve /opt/ktserve
RUN useradd --uid 1000 --create-home ktserve
ENV PATH=/opt/ktserve/bin:$PATH PYTHONUNBUFFERED=1
USER ktserve
WORKDIR /home/ktserve
ENTRYPOINT ["ktserve"]
CMD ["--help"]
