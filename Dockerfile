# The ql3 image: the `ql3` command line (migrate, relay, ...) and the SQL it migrates.
# Build: docker build -t ql3:local .   Run: docker run --rm ql3:local relay --help
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the wheel is built from: never a local virtualenv or caches.
COPY pyproject.toml README.md ./
COPY python ./python
COPY sql ./sql
RUN pip install '.[all]' \
    && rm -rf /src \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin ql3

WORKDIR /
USER ql3
# The relay's /metrics and /healthz (QL3_RELAY_METRICS_PORT).
EXPOSE 9464
ENTRYPOINT ["ql3"]
CMD ["--help"]
