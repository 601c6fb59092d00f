# The tokenrouter-ray image that the Helm chart (helm/) and the manifests (k8s/) run on every
# Ray pod: the official Ray GPU image, with the same Ray version as the chart's `rayVersion`,
# plus this package and its `gpu` extra (flash-attn). There are no model weights or routers in
# it. Checkpoints download into HF_HOME when a pod starts, and routers come from
# TOKENROUTER_ROUTER_DIR (a PVC or an init container, see docs/deployment/kubernetes.md).
#
#   docker build -t REGISTRY/tokenrouter-ray:0.1.0 .      # tag = the chart's appVersion
#   docker push REGISTRY/tokenrouter-ray:0.1.0
#
# Build arguments: RAY_VERSION must stay equal to rayVersion in helm/tokenrouter-ray/values.yaml
# (a test checks it). TORCH_VERSION picks the CUDA torch wheel from PyPI. Set WITH_GPU_EXTRA=0
# to skip flash-attn, which compiles from source (an hour or more, MAX_JOBS in parallel) when
# no prebuilt wheel matches the torch, CUDA and Python versions. Without flash-attn the engine
# uses PyTorch SDPA.
ARG RAY_VERSION=2.60.0
ARG PYTHON_TAG=py311

# Stage 1: build the wheel. The configs in conf/ go into it as package data, and loadtest/ and
# tests/ stay out.
# (COPY creates src/ owned by `ray`, so the in-tree build can write there; tokenrouter_ray/conf
# stays a link to ../conf, and the wheel gets a real copy.)
FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-gpu AS wheel
WORKDIR /home/ray
COPY --chown=ray:users pyproject.toml README.md src/
COPY --chown=ray:users conf src/conf
COPY --chown=ray:users deployments src/deployments
COPY --chown=ray:users tokenrouter_ray src/tokenrouter_ray
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /home/ray/wheels ./src

# Stage 2: the runtime image.
FROM rayproject/ray:${RAY_VERSION}-${PYTHON_TAG}-gpu
ARG RAY_VERSION
ARG TORCH_VERSION=2.13.0
ARG WITH_GPU_EXTRA=1
ARG MAX_JOBS=4
COPY --from=wheel --chown=ray:users /home/ray/wheels /home/ray/wheels
# torch goes in first: flash-attn builds against it, without build isolation. Pinning ray to
# the base image's version means pip can never swap it for another one.
RUN python -m pip install --no-cache-dir "torch==${TORCH_VERSION}" "ray[serve]==${RAY_VERSION}" \
    && wheel="$(ls /home/ray/wheels/tokenrouter_ray-*.whl)" \
    && extra="" && if [ "${WITH_GPU_EXTRA}" = "1" ]; then extra="[gpu]"; fi \
    && MAX_JOBS="${MAX_JOBS}" python -m pip install --no-cache-dir --no-build-isolation \
        "ray[serve]==${RAY_VERSION}" "torch==${TORCH_VERSION}" "tokenrouter-ray${extra} @ file://${wheel}" \
    && rm -rf /home/ray/wheels \
    && python -c "import ray, tokenrouter_ray.config as c, deployments.app; \
assert ray.__version__ == '${RAY_VERSION}', ray.__version__; assert (c.CONF_DIR / 'base.yaml').is_file()"
# Defaults the chart overrides: where checkpoints are cached and where routers are read from
# (a directory path, not a secret: hadolint reads "TOKEN" in the name as one).
# hadolint ignore=DL3064
ENV HF_HOME=/home/ray/.cache/huggingface \
    TOKENROUTER_ROUTER_DIR=/home/ray/routers \
    RAY_USAGE_STATS_ENABLED=0
WORKDIR /home/ray
# The base image's unprivileged `ray` user (uid 1000, group users = 100).
USER 1000:100
