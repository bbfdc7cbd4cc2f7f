# multireg — build, test and demo targets. `make test` is what CI runs.

GO       ?= go
# The release this tree is, or leads to: the VERSION file (semver with a leading v). The
# chart's version and appVersion follow it (e2e/manifests checks): the same on the release's
# commit, with -dev on the commits that lead to it.
RELEASE_VERSION := $(shell cat VERSION)
# What a build says it is (hack/version.sh): the VERSION file's on the release's tag, or with
# RELEASE=1 (the release workflow); on any other commit a pre-release of it with the commit as
# build metadata, v0.2.0-dev+9b9233c (-dirty when the tracked files differ from it). Stamped
# into the binary (`multireg version`, multireg_build_info) and the image's labels.
VERSION  := $(shell RELEASE=$(RELEASE) hack/version.sh)
ifeq ($(VERSION),)
$(error hack/version.sh printed no version)
endif
# The image's tag: VERSION with its + made a dot (a tag may not hold a +), v0.2.0-dev.9b9233c;
# on the release, VERSION.
IMAGE_TAG := $(subst +,.,$(VERSION))
# The commit, short in the binary and whole in the image's labels; -dirty when the tracked
# files differ from it.
COMMIT   ?= $(shell hack/version.sh commit)
REVISION ?= $(shell hack/version.sh revision)
# Every time stamp of the image is the commit's time (reproducible-builds.org's convention).
SOURCE_DATE_EPOCH ?= $(shell git log -1 --format=%ct 2>/dev/null || echo 0)
export SOURCE_DATE_EPOCH
# The same time in RFC 3339, as the image's label org.opencontainers.image.created says it
# (GNU date, else BSD's).
CREATED = $(shell date -u -d @$(SOURCE_DATE_EPOCH) +%Y-%m-%dT%H:%M:%SZ 2>/dev/null || date -u -r $(SOURCE_DATE_EPOCH) +%Y-%m-%dT%H:%M:%SZ)
# The image's platforms (hack/image builds the same list; its test checks).
PLATFORMS := linux/amd64 linux/arm64 linux/arm/v7 linux/ppc64le linux/s390x
# The platforms of the binaries a release attaches: the image's, and macOS's and Windows's
# (`multireg validate`, `status` and `version`; `run` is Linux's).
RELEASE_PLATFORMS := $(PLATFORMS) darwin/amd64 darwin/arm64 windows/amd64
# Where the release workflow publishes the image (the chart's default image.repository), and
# the repository the image's labels and the chart point at.
IMAGE_REPO := ghcr.io/multireg/multireg
CHART_REPO := oci://ghcr.io/multireg/charts
SOURCE_URL := https://github.com/multireg/multireg
# make image writes the binaries and the OCI image layout here; make image-push IMAGE=… pushes.
BINARIES ?= bin/platforms
LAYOUT   ?= bin/image
IMAGE    ?=
# IMAGE_INSECURE=true pushes over plain HTTP (a registry on a test host); localhost and
# 127.0.0.1 need no flag.
IMAGE_INSECURE ?=
# User-mode emulation of arm64 (Debian's qemu-user-static), for the unit tests on arm64.
QEMU_ARM64 ?= qemu-aarch64-static
# Pinned tools, built from the Go module proxy and cached (hack/go-tool.sh).
ACTIONLINT      := github.com/rhysd/actionlint/cmd/actionlint@v1.7.12
CYCLONEDX_GOMOD := github.com/CycloneDX/cyclonedx-gomod/cmd/cyclonedx-gomod@v1.10.0
GOVULNCHECK     := golang.org/x/vuln/cmd/govulncheck@v1.9.0
# The modules make vulncheck checks: the product's, and hack/image's, which builds the image
# and pushes it with the release's credentials.
VULNCHECK_MODULES := . hack/image
# The vulnerability database govulncheck reads: its own default, https://vuln.go.dev, unless
# set (a mirror's URL, or file:///PATH of a copy).
VULNDB ?=
FUZZTIME ?= 2m
# Prometheus's promtool, which checks and unit-tests the alerts: built from source once per
# release and Go toolchain (e2e/monitoring/build-promtool.sh), then cached here.
PROMTOOL ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/multireg/promtool/promtool
# KUBE=1.33, 1.34, 1.35 or 1.37 runs the demo against that kubelet's plugin manager instead of
# 1.36's (e2e/kube1XX/go.mod, built with the tag kube1XX).
KUBE     ?= 1.36
MODFILE  := $(if $(filter 1.33 1.34 1.35 1.37,$(KUBE)),-modfile=kube$(subst .,,$(KUBE))/go.mod -tags=kube$(subst .,,$(KUBE)),)

.PHONY: all build demo test test-nightly e2e-older unit fuzz vet fmt-check e2e manifests e2e-node bench promtool monitoring \
	binaries image image-push image-tool image-reproducible unit-arm64 sbom chart chart-readme \
	actionlint release-notes release-checks image-repo chart-repo platforms version image-tag \
	dockerfile-check build-args release-binaries faults-check vulncheck e2e-node-helm

all: build

## build: the multireg binary in bin/, static and stamped with the version.
## (the command that builds every binary of the image too: hack/build-binary.sh)
build:
	VERSION=$(VERSION) COMMIT=$(COMMIT) GO=$(GO) hack/build-binary.sh bin/multireg

## faults-check: the release's binary (make build) injects no fault: it holds no MULTIREG_TEST_
## variable and no multireg_faults tag (go version -m); the end-to-end tests' build of it
## (-tags multireg_faults, e2e/mrproc) holds both variables, so that the check is not vacuous.
faults-check: build
	@if grep -a -q MULTIREG_TEST_ bin/multireg; then \
		echo "bin/multireg holds MULTIREG_TEST_ variables: fault injection in a release build" >&2; exit 1; fi
	@if $(GO) version -m bin/multireg | grep -q multireg_faults; then \
		echo "bin/multireg is built with the tag multireg_faults" >&2; exit 1; fi
	@EXTRA_TAGS=multireg_faults VERSION=$(VERSION) COMMIT=$(COMMIT) GO=$(GO) hack/build-binary.sh bin/multireg-faults
	@n=$$(grep -a -o 'MULTIREG_TEST_HANDOVER_[A-Z]*' bin/multireg-faults | sort -u | wc -l); rm -f bin/multireg-faults; \
	if [ "$$n" -ne 2 ]; then echo "the fault-injecting build holds $$n of its 2 variables: faults-check proves nothing" >&2; exit 1; fi
	@echo "bin/multireg: no fault injection"

## binaries: the binary of every platform of the image, bin/platforms/<os>/<arch>[/<variant>]/.
binaries:
	@set -e; for p in $(PLATFORMS); do \
		os=$${p%%/*}; rest=$${p#*/}; arch=$${rest%%/*}; variant=$${rest#$$arch}; variant=$${variant#/v}; \
		GOOS=$$os GOARCH=$$arch GOARM=$${variant:-7} VERSION=$(VERSION) COMMIT=$(COMMIT) GO=$(GO) \
			hack/build-binary.sh $(BINARIES)/$$p/multireg; \
		echo "built $(BINARIES)/$$p/multireg"; \
	done

## release-binaries: the binaries a release attaches, bin/release/multireg-TAG-OS-ARCH[-VARIANT]
## (.exe on Windows; TAG is the image's tag, the version on a release), for RELEASE_PLATFORMS
## (Linux's are make binaries' own, the image's), with the node-condition agent beside each
## Linux one (multireg-nodecond-TAG-linux-ARCH[-VARIANT]: `multireg run` is Linux's only), and
## their checksums, bin/release/SHA256SUMS.
release-binaries: binaries
	@set -e; rm -rf bin/release; mkdir -p bin/release; \
	for p in $(RELEASE_PLATFORMS); do \
		os=$${p%%/*}; rest=$${p#*/}; arch=$${rest%%/*}; variant=$${rest#$$arch}; variant=$${variant#/v}; \
		out=bin/release/multireg-$(IMAGE_TAG)-$$(echo $$p | tr / -)$$(test $$os != windows || echo .exe); \
		if [ -f $(BINARIES)/$$p/multireg ]; then cp $(BINARIES)/$$p/multireg $$out; else \
			GOOS=$$os GOARCH=$$arch GOARM=$${variant:-7} VERSION=$(VERSION) COMMIT=$(COMMIT) GO=$(GO) \
				hack/build-binary.sh $$out; rm -f $$out-nodecond; fi; \
		echo "$$out"; \
		if [ -f $(BINARIES)/$$p/multireg-nodecond ]; then \
			agent=bin/release/multireg-nodecond-$(IMAGE_TAG)-$$(echo $$p | tr / -); cp $(BINARIES)/$$p/multireg-nodecond $$agent; echo "$$agent"; fi; \
	done; \
	cd bin/release && { sha256sum multireg-* 2>/dev/null || shasum -a 256 multireg-*; } >SHA256SUMS; \
	echo bin/release/SHA256SUMS

## image: the multi-platform image as an OCI image layout in bin/image, built without a daemon
## (hack/image, go-containerregistry): one layer per platform, /multireg, /multireg-nodecond
## (the node-condition agent) and /LICENSE.
image: binaries
	cd hack/image && $(GO) run . build -binaries $(abspath $(BINARIES)) -license $(CURDIR)/LICENSE \
		-version $(VERSION) -tag $(IMAGE_TAG) -commit $(REVISION) -source $(SOURCE_URL) -out $(abspath $(LAYOUT))

## image-push: push bin/image to IMAGE (REGISTRY/NAME) as IMAGE:$(IMAGE_TAG), with the usual
## credentials (docker login); prints IMAGE:TAG@DIGEST. IMAGE_INSECURE=true for plain HTTP.
image-push: image
	@test -n "$(IMAGE)" || { echo "usage: make image-push IMAGE=REGISTRY/NAME [IMAGE_INSECURE=true]" >&2; exit 2; }
	cd hack/image && $(GO) run . push -layout $(abspath $(LAYOUT)) -image $(IMAGE) $(if $(filter true,$(IMAGE_INSECURE)),-insecure)

## image-tool: hack/image's own checks (formatting, vet, tidy, tests).
image-tool:
	cd hack/image && test -z "$$(gofmt -l .)" && $(GO) vet ./... && $(GO) mod tidy -diff && $(GO) test -race -count=1 ./...

## image-reproducible: the image built a second time, from a copy of the tracked files at
## another path, must have the same index digest as bin/image.
image-reproducible: image
	rm -rf bin/repro && mkdir -p bin/repro/src
	git ls-files -z | tar --null -T - -cf - | tar -xf - -C bin/repro/src
	$(MAKE) -C bin/repro/src image VERSION=$(VERSION) COMMIT=$(COMMIT) REVISION=$(REVISION) SOURCE_DATE_EPOCH=$(SOURCE_DATE_EPOCH) \
		BINARIES=$(CURDIR)/bin/repro/platforms LAYOUT=$(CURDIR)/bin/repro/image >/dev/null
	@a=$$(cd hack/image && $(GO) run . digest -layout $(abspath $(LAYOUT))); \
	b=$$(cd hack/image && $(GO) run . digest -layout $(CURDIR)/bin/repro/image); \
	echo "image index: $$a"; echo "rebuilt:     $$b"; \
	if [ "$$a" != "$$b" ]; then echo "the image is not reproducible" >&2; exit 1; fi
	rm -rf bin/repro/src

## build-args: the Dockerfile's build arguments for this checkout, as docker build and buildah
## bud take them: `docker build $(make -s build-args) .` builds what make image builds.
build-args:
	@echo --build-arg VERSION=$(VERSION) --build-arg COMMIT=$(COMMIT) --build-arg REVISION=$(REVISION) \
		--build-arg SOURCE_DATE_EPOCH=$(SOURCE_DATE_EPOCH) --build-arg CREATED=$(CREATED)

## dockerfile-check: the Dockerfile built with buildah for linux/amd64 (no daemon, no registry:
## hack/dockerfile-check.sh) must give make image's linux/amd64 image, file by file and config
## field by config field (hack/image compare). Needs root, buildah and busybox-static.
dockerfile-check: image
	VERSION=$(VERSION) COMMIT=$(COMMIT) REVISION=$(REVISION) CREATED=$(CREATED) GO=$(GO) \
		hack/dockerfile-check.sh $(LAYOUT)

## unit-arm64: the product's unit tests compiled for arm64 and run under qemu user-mode
## emulation (no race detector there), so that the arm64 image holds code that ran.
unit-arm64:
	GOARCH=arm64 CGO_ENABLED=0 $(GO) test -count=1 -exec $(QEMU_ARM64) ./...

## sbom: a CycloneDX SBOM per platform and binary, bin/sbom/<os>-<arch>[-<variant>].cdx.json
## for multireg and …-nodecond.cdx.json for its node-condition agent, from the module graph
## linked into that binary (cyclonedx-gomod bin), with licenses.
sbom: binaries
	@set -e; tool=$$(hack/go-tool.sh cyclonedx-gomod $(CYCLONEDX_GOMOD)); mkdir -p bin/sbom; \
	for p in $(PLATFORMS); do for b in multireg multireg-nodecond; do \
		f=bin/sbom/$$(echo $$p | tr / -)$${b#multireg}.cdx.json; rest=$${p#*/}; \
		GOOS=$${p%%/*} GOARCH=$${rest%%/*} GOPROXY=off $$tool bin -json -disable-html-escape -licenses -noserial -notimestamp -version $(VERSION) \
			-output $$f $(BINARIES)/$$p/$$b 2>$$f.log || { cat $$f.log >&2; exit 1; }; \
		grep -q '"purl": "pkg:golang/multireg.dev/multireg@$(VERSION)?goarch='$${rest%%/*}'&goos=linux' $$f || \
			{ echo "$$f: the main component is not multireg $(VERSION) for $$p" >&2; exit 1; }; \
		echo "$$f"; \
	done; done

## chart: the Helm chart packaged as bin/chart/multireg-<version>.tgz (Helm's Go library).
chart:
	cd e2e/manifests && $(GO) run ./cmd/chart-package -chart $(CURDIR)/charts/multireg -out $(CURDIR)/bin/chart

## chart-readme: the values table of charts/multireg/README.md, from values.yaml's comments
## (make manifests fails while it is not current).
chart-readme:
	cd e2e/manifests && $(GO) run ./cmd/chart-readme -chart $(CURDIR)/charts/multireg

## release-notes: the CHANGELOG.md section of what is built, bin/release-notes.md (a release's
## notes): a release's own section (## VERSION), else the "## Unreleased" one; fails when there
## is none or it is empty.
release-notes:
	@mkdir -p bin
	@section=$(if $(filter $(RELEASE_VERSION),$(VERSION)),$(VERSION),Unreleased); \
	awk -v v="$$section" '/^## /{p = ($$2 == v || $$2 == "[" v "]"); next} p' CHANGELOG.md >bin/release-notes.md; \
	grep -q '[^[:space:]]' bin/release-notes.md || { echo "CHANGELOG.md has no section ## $$section" >&2; exit 1; }
	@echo bin/release-notes.md

# What the release workflow and the docs ask: what a build says it is, the image's tag, where a
# release publishes, and for which platforms.
version:
	@echo $(VERSION)
image-tag:
	@echo $(IMAGE_TAG)
image-repo:
	@echo $(IMAGE_REPO)
chart-repo:
	@echo $(CHART_REPO)
platforms:
	@echo $(PLATFORMS)

## actionlint: the forge's workflows (.github/workflows) checked by actionlint (and the shell of
## their steps by shellcheck, when installed).
actionlint:
	$$(hack/go-tool.sh actionlint $(ACTIONLINT)) -no-color

## vulncheck: the known vulnerabilities that the code of VULNCHECK_MODULES reaches, in its
## dependencies and in this Go toolchain's standard library: govulncheck (pinned, built from
## the Go module proxy) against the Go vulnerability database (VULNDB). Fails when a call path
## reaches a vulnerable function. It needs the database, which make test does not reach: the ci
## and nightly workflows run it as a job of its own.
vulncheck:
	@tool=$$(hack/go-tool.sh govulncheck $(GOVULNCHECK)) || exit 1; rc=0; \
	for m in $(VULNCHECK_MODULES); do \
		echo "=== govulncheck: $$m"; \
		(cd $$m && $$tool $(if $(VULNDB),-db $(VULNDB)) ./...) || rc=1; \
	done; exit $$rc

## demo: multireg registering three drivers with kubelet's real plugin manager, one after a failure.
demo: build
	cd e2e && $(GO) run $(MODFILE) ./cmd/demo -multireg ../bin/multireg -config ../examples/local/config.yaml

## test: what CI runs on every commit (.ci/run), 26 minutes from a cold cache on 2 cores
## (measured: CONTRIBUTING.md): formatting, vet, unit tests with the race detector (the fuzz target's seed
## corpus among them), the image's build command, what a release builds (release-checks, the
## macOS and Windows binaries among them), the end-to-end tests against kubelet 1.37's real
## plugin manager with the race detector, and the shipped manifests and Helm chart.
test: fmt-check vet unit build release-checks e2e manifests

## test-nightly: test, and what does not fit in a commit's CI run, which the scheduled workflow
## (.github/workflows/nightly.yaml) runs every night: the config parser fuzzed for FUZZTIME, the
## monitoring objects with promtool, the end-to-end tests against kubelet 1.33 to 1.36 too
## (1.36 with the race detector), the image built twice (equal digests), the arm64 unit tests
## under emulation, the real single-node Kubernetes 1.37 and 1.35, built from source (as
## root), and the README's install with Helm on a real node of 1.37. (make vulncheck, which
## needs the vulnerability database, is a job of its own in the workflow.)
test-nightly: test fuzz monitoring e2e-older image-reproducible unit-arm64 e2e-node e2e-node-helm

## release-checks: what the release workflow builds, built here without network: every
## platform's binary, the image, the Dockerfile's image against it, the SBOMs, the binaries a
## release attaches and their checksums, the chart's package, the workflows checked by
## actionlint, and no fault injection in the release's binary. (Its reproducibility and the
## arm64 unit tests: test-nightly.)
release-checks: image-tool image dockerfile-check sbom release-binaries chart release-notes actionlint faults-check

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet ./...

unit:
	$(GO) test -race -count=1 ./...

## fuzz: run the config parser's fuzz target for FUZZTIME (default 2m; test-nightly). Its seed
## corpus runs in make unit, on every commit.
fuzz:
	$(GO) test ./config -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME)

## e2e: the built binary against kubelet 1.37's real plugin manager, with the race detector;
## e2e-older: against 1.33, 1.34, 1.35 and 1.36 (1.36 with the race detector; test-nightly).
## (go test runs vet's checks on the packages it tests; `make -C e2e vet` runs the full vet of
## every build.)
e2e:
	$(MAKE) -C e2e test
e2e-older:
	$(MAKE) -C e2e test-older

## manifests: examples/ and the Helm chart decode strictly into their Kubernetes types, their
## multireg configs validate, and their paths agree with the DaemonSet's mounts.
## (With promtool: `promtool check rules` and `promtool test rules` on the alerts, strict decoding
## of the monitoring objects into the Prometheus Operator's types: see `monitoring`.)
manifests:
	$(MAKE) -C e2e/manifests fmt vet tidy-check test 'SKIP=$(PROMTOOL_TESTS)'

# The manifest tests that run Prometheus's promtool, which takes minutes to build on a cold
# cache: make monitoring runs them (test-nightly).
PROMTOOL_TESTS = ^(TestPrometheusRules|TestPromtoolCatchesBrokenRules|TestMonitoringChart|TestMonitoringExamples|TestDashboardQueriesParse)$$

## promtool: Prometheus's promtool at $(PROMTOOL) (about 3.5 min cold on 2 cores, then cached).
promtool:
	e2e/monitoring/build-promtool.sh $(dir $(PROMTOOL)) >/dev/null

## monitoring: the alerts, the chart's and examples' monitoring objects, and the dashboard, with
## Prometheus's promtool (make test-nightly; make test runs the rest of the manifest tests):
## promtool's unit tests of every alert, strict decoding into the Operator's types, and every
## metric the dashboard names in a live /metrics.
monitoring: promtool
	cd e2e/manifests && PROMTOOL=$(PROMTOOL) $(GO) test -count=1 -v -run '^(TestPrometheusRules|TestPromtoolCatchesBrokenRules|TestMonitoring.*|TestDashboardQueriesParse)$$' .
	cd e2e && $(GO) test -race -count=1 -v -run '^(TestDashboardMetricsExist|TestMetricNames)$$' ./registration

## e2e-node: a real single-node Kubernetes built from source (kubelet, API server, controller
## manager, scheduler; etcd and containerd from Debian) with bin/multireg on the host and the
## shipped DaemonSet running the image of bin/image, which the node pulls from a registry in the
## test process, by digest and by tag: CSINode, device capacity, DRA, a kubelet restart,
## ConfigMap edits, a rollout restart. On Kubernetes 1.37 then 1.35 (`KUBE=1.35` for one: see
## e2e/node/Makefile). Needs root; installs its Debian packages; caches each release's binaries.
e2e-node: build image
	$(MAKE) -C e2e/node fmt tidy-check test MULTIREG=$(CURDIR)/bin/multireg LAYOUT=$(abspath $(LAYOUT))

## e2e-node-helm: the README's install with Helm, its commands run as written (e2e/node's
## TestHelmInstall, with -helm), on a real single-node Kubernetes of its own, 1.37 (KUBE=1.35
## for another): make image-push to the test's registry, helm install, rollout status, multireg
## status in the pod, helm test, an upgrade that moves one driver, a rollback and the
## uninstall. Part of test-nightly, after e2e-node; as root.
e2e-node-helm: build image
	$(MAKE) -C e2e/node deps release helm MULTIREG=$(CURDIR)/bin/multireg LAYOUT=$(abspath $(LAYOUT))

## bench: bin/multireg against kubelet's real plugin manager, beside the sidecar baseline, into
## BENCHMARKS.md (about 25 min; not part of test).
bench: build
	MULTIREG_BIN=$(CURDIR)/bin/multireg $(MAKE) -C e2e bench
