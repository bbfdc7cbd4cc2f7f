# multireg's image, for container builders: docker build, buildah bud, kaniko, OpenShift builds.
# It builds, for one platform, the image `make image` builds (hack/image: the release's path,
# reproducible, every platform at once, no daemon; CONTRIBUTING.md): FROM scratch, /multireg
# (the static binary hack/build-binary.sh builds) and /LICENSE, entrypoint /multireg, user 0:0,
# the same labels. `make dockerfile-check` builds it with buildah and compares the two, file by
# file and field by field.
#
#   docker build $(make -s build-args) -t REGISTRY/multireg:$(make -s image-tag) .
#   docker buildx build --platform linux/arm64 $(make -s build-args) -t … .
#   buildah bud $(make -s build-args) --timestamp "$(git log -1 --format=%ct)" \
#     --identity-label=false --unsetenv PATH -t … .   (exactly make image's linux/amd64 image)
#
# Build arguments (`make -s build-args` prints them for the checkout):
#   VERSION, COMMIT    what the binary says (hack/version.sh: v0.2.0-dev+9b9233c, 9b9233c);
#                      without them it says the VERSION file's development version of an
#                      unknown commit (v0.2.0-dev+unknown): the context holds no .git
#   REVISION           the whole commit, the label org.opencontainers.image.revision
#   SOURCE_DATE_EPOCH  the commit's time (BuildKit makes it the image's creation time);
#                      CREATED, the same in RFC 3339, the label org.opencontainers.image.created
#   GO_IMAGE           the Go toolchain's image (default golang:1.26, the go.mod's Go)
#   GOPROXY            the Go module proxy, for a mirror
ARG GO_IMAGE=golang:1.26

# The binary, cross-compiled on the builder's own platform for the target's.
FROM --platform=$BUILDPLATFORM ${GO_IMAGE} AS build
ARG TARGETOS
ARG TARGETARCH
ARG TARGETVARIANT
ARG GOPROXY
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION
ARG COMMIT
RUN mkdir -p /out \
	&& variant=${TARGETVARIANT#v} \
	&& GOOS=${TARGETOS:-linux} GOARCH=$TARGETARCH GOARM=${variant:-7} VERSION=$VERSION COMMIT=$COMMIT \
		hack/build-binary.sh /out/multireg \
	&& cp LICENSE /out/LICENSE \
	&& chmod 0755 /out/multireg /out/multireg-nodecond \
	&& chmod 0644 /out/LICENSE

# The image: the binaries (multireg, its node-condition agent) and the license, nothing else (no libc, shell, certificates or time
# zones: CONTRIBUTING.md says why).
FROM scratch
COPY --from=build /out/ /
# Root, on purpose: kubelet's plugins-registry directory is owned by root. The manifests drop
# every capability and make the root filesystem read-only.
USER 0:0
ENTRYPOINT ["/multireg"]
ARG VERSION
ARG REVISION
ARG CREATED
ARG SOURCE_DATE_EPOCH
LABEL org.opencontainers.image.title="multireg" \
	org.opencontainers.image.description="Registers every kubelet plugin of a node (CSI drivers, DRA drivers, device plugins) from one drivers file" \
	org.opencontainers.image.version="${VERSION}" \
	org.opencontainers.image.revision="${REVISION}" \
	org.opencontainers.image.source="https://github.com/multireg/multireg" \
	org.opencontainers.image.licenses="Apache-2.0" \
	org.opencontainers.image.created="${CREATED}"
