# One image for every ktserve service: `ktserve serve` (the GPU service) and `ktserve expert`.
#
#   docker build -t ktserve .          torch from the default index (the CUDA build on Linux)
#   docker build --build-arg TORCH_SPEC=torch==2.13.0+cpu \
#     --build-arg PIP_ARGS="--extra-index-url URL_OF_A_CPU_WHEEL_INDEX" -t ktserve .
#
#   docker build --build-arg OPTIONAL_PACKAGES=sgl-flash-mla==1.0.0 -t ktserve .
#                                      FlashMLA for MLA decode on Hopper GPUs (README: "FlashMLA,
#                                      where it is installed")
#
# BASE_IMAGE: any Debian-based image with Python >= 3.11, its headers and venv (the official
# python:3.11-slim has them). PIP_ARGS go to every pip install (e.g. --find-links DIR).
# OPTIONAL_PACKAGES: packages ktserve uses where present, installed without their dependencies
# (sgl-flash-mla's metadata names a newer torch than the one its stable-ABI build needs).
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ make \
 && rm -rf /var/lib/apt/lists/*
ARG TORCH_SPEC=torch>=2.4,<2.14
ARG PIP_ARGS=""
# NOTE: a CA bundle for a TLS-intercepting proxy, mounted into the build (podman build -v).
ARG PIP_CERT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# NOTE: torch first, in its own layer, so that the project's range cannot swap it for another
# build and source changes do not download it again.
RUN python3 -m venv /opt/ktserve && /opt/ktserve/bin/pip install ${PIP_ARGS} "${TORCH_SPEC}"
# NOTE: then the project's dependencies and build requirements, read from pyproject.toml alone,
# in a layer of their own: a source change rebuilds only the project (without build isolation,
# from the requirements installed here).
COPY pyproject.toml /src/pyproject.toml
RUN /opt/ktserve/bin/python -c "import tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb')); \
      print('\n'.join(p['project']['dependencies'] + p['build-system']['requires']))" \
      > /tmp/requirements.txt \
 && /opt/ktserve/bin/pip install ${PIP_ARGS} -r /tmp/requirements.txt
ARG OPTIONAL_PACKAGES=""
RUN if [ -n "${OPTIONAL_PACKAGES}" ]; then \
      /opt/ktserve/bin/pip install ${PIP_ARGS} --no-deps ${OPTIONAL_PACKAGES}; fi
COPY . /src
RUN /opt/ktserve/bin/pip install ${PIP_ARGS} --no-build-isolation --no-deps /src

FROM ${BASE_IMAGE}
COPY --from=build /opt/ktserve /opt/ktserve
RUN useradd --uid 1000 --user-group --create-home ktserve
ENV PATH=/opt/ktserve/bin:$PATH PYTHONUNBUFFERED=1
USER ktserve
WORKDIR /home/ktserve
ENTRYPOINT ["ktserve"]
CMD ["--help"]
