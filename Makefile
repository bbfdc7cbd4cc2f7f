# multireg — build, test and demo targets. `make test` is what CI runs.

GO       ?= go
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo devel)
COMMIT   ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
LDFLAGS  := -s -w -X main.version=$(VERSION) -X main.commit=$(COMMIT)
FUZZTIME ?= 20s
# KUBE=1.35 runs the demo against kubelet 1.35's plugin manager instead of 1.36's.
KUBE     ?= 1.36
MODFILE  := $(if $(filter 1.35,$(KUBE)),-modfile=kube135/go.mod,)

.PHONY: all build demo test unit fuzz vet fmt-check e2e

all: build

## build: the multireg binary in bin/, static and stamped with the version.
build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags "$(LDFLAGS)" -o bin/multireg ./cmd/multireg

## demo: multireg registering three drivers with kubelet's real plugin manager, one after a failure.
demo: build
	cd e2e && $(GO) run $(MODFILE) ./cmd/demo -multireg ../bin/multireg

## test: everything CI runs: formatting, vet, unit tests with the race detector, a fuzz smoke
## run, and the end-to-end tests against kubelet 1.36 and 1.35.
test: fmt-check vet unit fuzz e2e

fmt-check:
	@out=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

vet:
	$(GO) vet ./...

unit:
	$(GO) test -race -count=1 ./...

## fuzz: run the config parser's fuzz target for FUZZTIME (default 20s).
fuzz:
	$(GO) test ./config -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(FUZZTIME)

## e2e: the built binary against the real kubelet plugin manager, kubelet 1.36 and 1.35 (-race).
e2e:
	$(MAKE) -C e2e vet test
