# osscar-service for GPU nodes: the gRPC server (`osscar serve`) with the CUDA build of torch 2.13.0 and
# ONNX Runtime's CUDA execution provider, used for measurement when a GPU is present (the server picks
# cuda when ONNX Runtime offers it and a session really runs on it). The host needs the NVIDIA driver and
# container toolkit (`docker run --gpus all ...`); CUDA and cuDNN libraries come from the wheels.
#
# One CUDA for both: onnxruntime-gpu 1.31.1 from PyPI is built for CUDA 13 (its CUDA provider links
# libcublas.so.13, libcublasLt.so.13, libcudart.so.13, libcurand.so.10 and the driver's libcuda.so.1, and loads
# cuDNN 9 for CUDA 13 at run time), so torch
# is its CUDA 13 build (cu130), whose nvidia-* runtime wheels bring exactly those libraries. A cu128 torch
# would bring CUDA 12.8 libraries: the provider would not load and ONNX Runtime would silently measure on
# the CPU. The build fails when any library of the provider does not resolve.
#
#   docker build -t osscar .
#   docker run --gpus all -p 50051:50051 -v osscar-data:/data \
#       -v /path/to/tls:/tls:ro -e OSSCAR_TLS_CERT=/tls/server.pem -e OSSCAR_TLS_KEY=/tls/server.key \
#       -e OSSCAR_TOKENS_FILE=/tls/tokens osscar
#
# The server binds 0.0.0.0 in the container, so it refuses to start without TLS and authentication
# (tokens or mTLS) unless OSSCAR_INSECURE=true: configure them through OSSCAR_* variables (README).
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    OSSCAR_HOME=/data \
    OSSCAR_HOST=0.0.0.0 \
    OSSCAR_PORT=50051 \
    OSSCAR_HEALTH_PORT=50052

WORKDIR /opt/osscar

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# torch first, from the CUDA 13 index, so that installing the package never resolves another torch
RUN pip install --index-url https://download.pytorch.org/whl/cu130 torch==2.13.0

COPY pyproject.toml README.md ./
COPY compressor ./compressor
COPY exporters ./exporters
COPY service ./service

# the CPU onnxruntime (a base dependency) and onnxruntime-gpu install the same module: keep only the GPU one.
# The ray extra: the same image is a Ray node (README "Jobs on a Ray cluster").
# The package itself comes from the build context (its dependencies' bounds are in pyproject.toml).
# hadolint ignore=DL3013
RUN pip install '.[gpu,ray]' \
    && pip uninstall -y onnxruntime \
    && pip install --force-reinstall --no-deps onnxruntime-gpu==1.31.1

# The CUDA libraries of the nvidia-* wheels on the loader's path, then every library of ONNX Runtime's CUDA
# provider must resolve (ldd needs no GPU) but the driver's libcuda.so.1, which no wheel ships: the NVIDIA container
# toolkit mounts the host's at run time, and a build has none.
RUN site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && find "$site/nvidia" -name 'lib*.so*' -printf '%h\n' | sort -u > /etc/ld.so.conf.d/osscar-cuda.conf \
    && ldconfig \
    && provider="$site/onnxruntime/capi/libonnxruntime_providers_cuda.so" \
    && test -f "$provider" \
    && missing="$(ldd "$provider" | grep 'not found' | grep -v 'libcuda\.so\.1 ' || true)" \
    && if [ -n "$missing" ]; then echo "the CUDA provider's libraries do not resolve:"; echo "$missing"; exit 1; fi

RUN useradd --create-home --uid 10001 osscar \
    && mkdir -p /data \
    && chown osscar:osscar /data
USER 10001
VOLUME ["/data"]
EXPOSE 50051

HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["osscar", "health", "--server", "127.0.0.1:50052"]

ENTRYPOINT ["osscar", "serve"]
