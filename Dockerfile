# syntax=docker/dockerfile:1
#
# The multireg image: one static binary on distroless/static.
#
#   docker buildx build --platform linux/amd64,linux/arm64 \
#     --build-arg VERSION=$(git describe --tags --always --dirty) \
#     --build-arg COMMIT=$(git rev-parse --short HEAD) \
#     -t REGISTRY/multireg:TAG --push .
#
# The build stage runs hack/build-binary.sh, the same command CI runs, so the binary in the image
# is the one CI builds.

ARG GO_VERSION=1.26
ARG BASE_IMAGE=gcr.io/distroless/static:latest

# Build on the build machine's platform and cross-compile (CGO_ENABLED=0 needs no C toolchain).
FROM --platform=$BUILDPLATFORM golang:${GO_VERSION} AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN --mount=type=cache,target=/go/pkg/mod \
    go mod download
COPY . .
ARG TARGETOS
ARG TARGETARCH
ARG VERSION=devel
ARG COMMIT=unknown
RUN --mount=type=cache,target=/go/pkg/mod \
    --mount=type=cache,target=/root/.cache/go-build \
    GOOS=$TARGETOS GOARCH=$TARGETARCH VERSION=$VERSION COMMIT=$COMMIT \
    hack/build-binary.sh /out/multireg

FROM ${BASE_IMAGE}
ARG BASE_IMAGE
ARG VERSION=devel
ARG COMMIT=unknown
LABEL org.opencontainers.image.title="multireg" \
      org.opencontainers.image.description="Registers every kubelet plugin of a node (CSI drivers, DRA drivers, device plugins) from one drivers file" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${COMMIT}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"
COPY --from=build /out/multireg /multireg
# Root, on purpose: kubelet's plugins-registry directory (/var/lib/kubelet/plugins_registry) is
# owned by root, and multireg creates its registration sockets there. It needs no capability
# and no privilege: the DaemonSet drops them all and makes the root filesystem read-only.
USER 0:0
ENTRYPOINT ["/multireg"]
