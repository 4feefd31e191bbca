# deepepd — one GNU Makefile for the daemon, the client library, the ctl,
# the CUDA kernels (where nvcc exists) and the tests.
#
#   make                 build everything into $(BUILD)/
#   make check           build and run the test suite (GPU tests skip without a GPU)
#   make check-gpu       only the GPU-tagged tests (on the GPU machine)
#   make check-includes  each part reaches only neutral ground (tools/includes.py)
#   make check-python    the Python package's tests (python/tests, pytest, host backend)
#   make check-rdma      Soft-RoCE scenarios (tests/rdma/) in QEMU guests; root only
#   make asan            the test suite under ASan + UBSan (in build-asan/)
#   make tsan            the threaded host suites under ThreadSanitizer (in build-tsan/)
#   make fuzz            build the libFuzzer harnesses (clang) and run each briefly
#   make deps            install missing Debian packages (apt-get; sudo when not root):
#                        `make deps run` only what building and running the daemon needs
#   make run             build and start deepepd in the foreground (host backend, ./run/)
#   make install PREFIX=/usr/local DESTDIR=
#   make uninstall       remove what make install installed (same PREFIX, DESTDIR)
#   make deb             the Debian packages (debian/, dpkg-buildpackage) into $(BUILD)/deb/
#
# Knobs (?=): PREFIX SYSCONFDIR RUNSTATEDIR CUDA_HOME NVCC_GENCODE PTX_ONLY WERROR STATIC_DEPS PYTHON

PREFIX      ?= /usr/local
BINDIR      ?= $(PREFIX)/bin
SBINDIR     ?= $(PREFIX)/sbin
# On Debian and its derivatives the library goes in the multiarch directory
# (/usr/lib/x86_64-linux-gnu, /usr/local/lib/x86_64-linux-gnu: both on the
# loader's path there), as the distribution's own libraries do.
MULTIARCH   := $(if $(wildcard /etc/debian_version),$(shell $(CC) -print-multiarch 2>/dev/null))
LIBDIR      ?= $(PREFIX)/lib$(if $(MULTIARCH),/$(MULTIARCH))
INCLUDEDIR  ?= $(PREFIX)/include
MANDIR      ?= $(PREFIX)/share/man
SYSCONFDIR  ?= /etc
RUNSTATEDIR ?= /run
UNITDIR     ?= $(PREFIX)/lib/systemd/system
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
TMPFILESDIR ?= $(PREFIX)/lib/tmpfiles.d
CUDA_HOME   ?= /usr/local/cuda
NVCC        ?= $(CUDA_HOME)/bin/nvcc
NVCC_GENCODE ?= -gencode arch=compute_80,code=sm_80 \
                -gencode arch=compute_90,code=sm_90 \
                -gencode arch=compute_100,code=sm_100 \
                -gencode arch=compute_100,code=compute_100
# PTX_ONLY=90 builds the kernels as compute_90 PTX alone, no SASS: what a GPU
# newer than the build meets, so that the daemon's kernel cache has work to do
# (its GPU tests and bench/kcache; e.g. make BUILD=build-ptx PTX_ONLY=90).
PTX_ONLY    ?=
ifneq ($(PTX_ONLY),)
NVCC_GENCODE := -gencode arch=compute_$(PTX_ONLY),code=compute_$(PTX_ONLY)
endif
BUILD       ?= build
WERROR      ?= $(if $(CI),1,0)
# STATIC_DEPS=1 links libuv, libyaml, check and subunit statically so that the
# binaries run on the GPU machine, which has none of them (DEVICE.md).
STATIC_DEPS ?= 0

CC      ?= cc
# Debian's interpreter, which python3-torch/numpy/pytest belong to (PATH may put another first).
PYTHON  ?= /usr/bin/python3
CFLAGS  ?= -O2 -g
WARN    := -Wall -Wextra -Wshadow -Wstrict-prototypes -Wmissing-prototypes -Wno-unused-parameter
ifeq ($(WERROR),1)
WARN    += -Werror
endif
CPPFLAGS += -std=c11 -D_GNU_SOURCE -DDEP_SYSCONFDIR='"$(SYSCONFDIR)"' -DDEP_RUNSTATEDIR='"$(RUNSTATEDIR)"'
ALLCFLAGS = $(CPPFLAGS) $(CFLAGS) $(WARN) -fPIC -fvisibility=hidden -MMD -MP $(SANFLAGS)

# Each part compiles against its own folder and the neutral ground it
# shares (DESIGN §2), so that a part that includes another's header fails to
# build: include/ (the public API, deepep.h), proto/ (the protocols, layouts
# and the launcher/kernel interface), config/, render/ and cuda/.  The
# daemon reaches one folder of the library's, client/daemon_api/, the
# library's internal interface for it (deepep_daemon.h); deepepctl uses the
# library's internal header client_internal.h, whose handle holds kernels/'
# host state and cuda/'s types.  Tests and benchmarks see every part.
# tools/includes.py (make check-includes, part of make check) holds them to it.
INC_proto   := -Iinclude -Iproto
INC_config  := $(INC_proto) -Iconfig
INC_cuda    := $(INC_proto) -Icuda
INC_render  := $(INC_proto) -Irender
INC_kernels := $(INC_proto) -Ikernels
INC_daemon  := $(INC_proto) -Idaemon -Iconfig -Irender -Icuda -Iclient/daemon_api
INC_client  := $(INC_proto) -Iclient -Iclient/daemon_api -Ikernels -Icuda
INC_ctl     := $(INC_proto) -Iclient -Irender -Icuda -Ikernels
INC_ALL     := $(INC_proto) -Iclient -Iclient/daemon_api -Iconfig -Idaemon -Ikernels -Irender -Icuda
INC_tests   := $(INC_ALL)
INC_bench   := $(INC_ALL)
# The include path of source file $1: its part's (deepepctl is client/ctl*.c).
part_inc = $(or $(if $(filter client/ctl%,$1),$(INC_ctl)),$(INC_$(firstword $(subst /, ,$1))),\
  $(error $1: no include path for its folder; add INC_<folder> to the Makefile))

PKGS_DAEMON := libuv yaml-0.1
PKGS_TEST   := check
ifeq ($(STATIC_DEPS),1)
ARCHLIB   := /usr/lib/$(shell $(CC) -print-multiarch)
LIBS_UV   := $(ARCHLIB)/libuv_a.a -lpthread -ldl
LIBS_YAML := $(ARCHLIB)/libyaml.a
LIBS_SODIUM := $(ARCHLIB)/libsodium.a
LIBS_CHECK := $(ARCHLIB)/libcheck_pic.a $(ARCHLIB)/libsubunit.a -lm -lrt -lpthread
else
LIBS_UV   := $(shell pkg-config --libs libuv 2>/dev/null || echo -luv)
LIBS_YAML := $(shell pkg-config --libs yaml-0.1 2>/dev/null || echo -lyaml)
# libsodium: the MAC and the random challenges of the peer handshake (daemon/peer.c).
LIBS_SODIUM := $(shell pkg-config --libs libsodium 2>/dev/null || echo -lsodium)
LIBS_CHECK := $(shell pkg-config --libs check 2>/dev/null || echo -lcheck -lsubunit -lm -lrt -lpthread)
endif

# ---- sources: the folder says which program a file belongs to -------------
PROTO_SRC  := $(wildcard proto/*.c)
CONFIG_SRC := $(wildcard config/*.c)
KHOST_SRC  := $(wildcard kernels/*.c)
# cuda/: the seam to the CUDA driver (dlopen of libcuda) and the kernels'
# built image, which the library (to launch) and the daemon (its devices,
# pools and kernel cache) both use; kernels/ is what the library runs.
CUDA_SRC   := $(wildcard cuda/*.c)
# render/: the output table and the records' views, which deepepctl and
# deepepd (metrics.listen serves the exposition deepepctl prints) both link.
RENDER_SRC := $(wildcard render/*.c)
KCUDA_SRC  := $(wildcard kernels/*.cu)
DAEMON_SRC := $(wildcard daemon/*.c)
CTL_SRC    := $(wildcard client/ctl*.c)
LIB_SRC    := $(filter-out $(CTL_SRC),$(wildcard client/*.c))
TEST_SRC   := $(wildcard tests/check_*.c) tests/runner.c
TESTLIB_SRC := $(filter-out tests/runner.c tests/fuzz_%.c $(wildcard tests/check_*.c),$(wildcard tests/*.c))
BENCHLIB_SRC := bench/benchlib.c
BENCH_SRC  := $(filter-out $(BENCHLIB_SRC),$(wildcard bench/*.c))
FUZZ_SRC   := $(wildcard tests/fuzz_*.c)

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))
PROTO_OBJ  := $(call obj,$(PROTO_SRC))
CONFIG_OBJ := $(call obj,$(CONFIG_SRC))
KHOST_OBJ  := $(call obj,$(KHOST_SRC))
CUDA_OBJ   := $(call obj,$(CUDA_SRC))
RENDER_OBJ := $(call obj,$(RENDER_SRC))
DAEMON_OBJ := $(call obj,$(DAEMON_SRC))
CTL_OBJ    := $(call obj,$(CTL_SRC))
LIB_OBJ    := $(call obj,$(LIB_SRC))
TEST_OBJ   := $(call obj,$(TEST_SRC))
TESTLIB_OBJ := $(call obj,$(TESTLIB_SRC))
DAEMON_MAIN := $(BUILD)/obj/daemon/main.o
# deepepctl's files the test runner links beside those: doctor's decisions,
# which tests/check_doctor.c runs on simulated GPUs.
CTLTEST_OBJ := $(call obj,client/ctl_doctor_judge.c)

# ---- CUDA: a fatbin embedded in the library where nvcc exists ---------------
HAVE_NVCC := $(shell test -x $(NVCC) && echo 1)
ifneq ($(HAVE_NVCC),)
ifneq ($(KCUDA_SRC),)
FATBIN     := $(BUILD)/kernels/deepep_kernels.fatbin
FATBIN_OBJ := $(BUILD)/obj/cuda/fatbin_blob.o
LIB_OBJ    += $(FATBIN_OBJ)
CPPFLAGS   += -DDEP_HAVE_FATBIN=1
endif
else
$(info deepepd: nvcc not found at $(NVCC); building the host-only library (set CUDA_HOME to enable CUDA kernels))
endif

# The version is deepep.h's (DEP_VERSION_STRING); the library's file, the .pc
# and the Python package take it from there.  The man pages carry it in their
# .TH lines in the tree, so that `man -l man/deepepd.8` shows it too; the man
# suite holds those to this one.
VERSION  := $(shell sed -n 's/^\#define DEP_VERSION_STRING "\(.*\)"/\1/p' include/deepep.h)
SONAME   := libdeepep-client.so.$(firstword $(subst ., ,$(VERSION)))
LIB_SO   := $(BUILD)/libdeepep-client.so.$(VERSION)
LIB_A    := $(BUILD)/libdeepep-client.a
DAEMON   := $(BUILD)/deepepd
CTL      := $(BUILD)/deepepctl
TESTS    := $(BUILD)/check_deepepd
BENCHES  := $(patsubst bench/%.c,$(BUILD)/bench/%,$(BENCH_SRC))
# bench/hostbus.cu measures the bus between a GPU and pinned host memory, the
# ceiling of the cuda path between nodes: a CUDA program of its own (the
# runtime linked statically), built where nvcc exists.
# Its rule is with the others' below (a rule here would be make's default goal).
ifneq ($(HAVE_NVCC),)
BENCHES += $(BUILD)/bench/hostbus
endif

.PHONY: all check check-includes check-python check-rdma check-gpu asan tsan fuzz deps run install uninstall deb clean \
        verify-unit lint-man
all: $(DAEMON) $(CTL) $(LIB_SO) $(BUILD)/libdeepep-client.so $(LIB_A) $(BUILD)/deepep-client.pc $(BENCHES)

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(@D)
	$(CC) $(ALLCFLAGS) $(call part_inc,$<) -c $< -o $@

ifneq ($(FATBIN),)
$(FATBIN): $(KCUDA_SRC) $(wildcard kernels/*.cuh) proto/kabi.h proto/ccuda.h proto/slab.h \
           proto/shape.h proto/stats_page.h proto/xring.h include/deepep.h
	@mkdir -p $(@D)
	$(NVCC) -fatbin -O3 -std=c++17 $(INC_kernels) $(NVCC_GENCODE) -o $@ $(KCUDA_SRC)
# The fatbin is embedded with .incbin so the library needs no file at run time,
# with its build id beside it: the SHA-256 of the fatbin, by which the daemon's
# kernel cache (which links this same object) keys what it compiled from it and
# the library knows a cached compile of its own kernels (cuda/kimage.h), whose
# object it is, in cuda/ with it.
$(FATBIN_OBJ): $(FATBIN)
	@mkdir -p $(@D)
	id=$$(sha256sum $< | cut -c1-64); \
	printf '.section .rodata\n.balign 64\n.global dep__fatbin\n.hidden dep__fatbin\ndep__fatbin:\n.incbin "%s"\n.global dep__fatbin_end\n.hidden dep__fatbin_end\ndep__fatbin_end:\n.global dep__fatbin_id\n.hidden dep__fatbin_id\ndep__fatbin_id:\n.asciz "%s"\n.section .note.GNU-stack,"",@progbits\n' $(abspath $<) $$id | $(CC) -c -x assembler - -o $@
# NVCC_GENCODE is part of what the fatbin is made from: a build directory made
# with other targets rebuilds it.
$(BUILD)/kernels/gencode: FORCE
	@mkdir -p $(@D)
	@echo '$(NVCC_GENCODE)' | cmp -s - $@ || echo '$(NVCC_GENCODE)' > $@
$(FATBIN): $(BUILD)/kernels/gencode
endif
.PHONY: FORCE
FORCE:

$(LIB_SO): $(LIB_OBJ) $(PROTO_OBJ) $(CUDA_OBJ) $(KHOST_OBJ) client/libdeepep-client.map
	$(CC) -shared -Wl,-soname,$(SONAME) -Wl,--version-script=client/libdeepep-client.map \
	  -Wl,--no-undefined $(SANFLAGS) $(LDFLAGS) -o $@ $(LIB_OBJ) $(PROTO_OBJ) $(CUDA_OBJ) $(KHOST_OBJ) -ldl -lpthread -lm
$(BUILD)/libdeepep-client.so: $(LIB_SO)
	ln -sf $(notdir $(LIB_SO)) $(BUILD)/$(SONAME)
	ln -sf $(notdir $(LIB_SO)) $@
$(LIB_A): $(LIB_OBJ) $(PROTO_OBJ) $(CUDA_OBJ) $(KHOST_OBJ)
	rm -f $@
	ar rcs $@ $^

# The daemon links the CUDA seam and the library's fatbin object (cuda/: its
# kernel cache compiles the very kernels this build's library carries) and
# the library itself: its start-up warm-up (warmup.c) and its tuner
# (tunechild.c) run the library's own code in child processes, through
# deepep.h as a trainer does, plus what client/daemon_api/deepep_daemon.h
# declares, the library's internal interface for the daemon (dep__ symbols,
# linked from the static archive); of kernels/, only what that library carries.
$(DAEMON): $(DAEMON_OBJ) $(CONFIG_OBJ) $(PROTO_OBJ) $(CUDA_OBJ) $(FATBIN_OBJ) $(RENDER_OBJ) $(LIB_A)
	$(CC) $(SANFLAGS) $(LDFLAGS) -o $@ $(DAEMON_OBJ) $(CONFIG_OBJ) $(PROTO_OBJ) $(CUDA_OBJ) $(FATBIN_OBJ) \
	  $(RENDER_OBJ) $(LIB_A) $(LIBS_UV) $(LIBS_YAML) $(LIBS_SODIUM) -ldl -lpthread -lm

$(CTL): $(CTL_OBJ) $(RENDER_OBJ) $(LIB_A)
	$(CC) $(SANFLAGS) $(LDFLAGS) -o $@ $(CTL_OBJ) $(RENDER_OBJ) $(LIB_A) -ldl -lpthread -lm

# Each bench/<name>.c is one program, with the shared helpers of benchlib.c
# and its own parts, bench/<name>/*.c where it has them, plus the daemon
# modules BENCH_DAEMON_<name> names and the libraries BENCH_LIBS_<name>.
# bench/peers runs the daemon's own peer handshake and RDMA seam.
BENCH_DAEMON_peers := daemon/peerauth.c daemon/rdmadrv.c daemon/log.c
BENCH_LIBS_peers = $(LIBS_SODIUM)
.SECONDEXPANSION:
.SECONDARY: $(call obj,$(BENCHLIB_SRC) $(wildcard bench/*/*.c))
$(BUILD)/bench/%: bench/%.c $(call obj,$(BENCHLIB_SRC)) $$(call obj,$$(wildcard bench/%/*.c) $$(BENCH_DAEMON_$$*)) $(LIB_A)
	@mkdir -p $(@D)
	$(CC) $(ALLCFLAGS) $(INC_bench) -o $@ $< $(call obj,$(BENCHLIB_SRC) $(wildcard bench/$*/*.c) $(BENCH_DAEMON_$*)) \
	  $(LIB_A) $(BENCH_LIBS_$*) -ldl -lpthread -lm
ifneq ($(HAVE_NVCC),)
$(BUILD)/bench/hostbus: bench/hostbus.cu $(BUILD)/kernels/gencode
	@mkdir -p $(@D)
	$(NVCC) -O3 -std=c++17 $(NVCC_GENCODE) -cudart static -o $@ $<
endif

# install writes the .pc again: PREFIX on the install line may differ from the build's.
PC_SED = sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@LIBDIR@|$(LIBDIR)|g' \
	    -e 's|@INCLUDEDIR@|$(INCLUDEDIR)|g' -e 's|@VERSION@|$(VERSION)|g'
$(BUILD)/deepep-client.pc: client/deepep-client.pc.in Makefile
	$(PC_SED) $< > $@

# The test runner links the daemon's modules (minus main) so unit tests can
# reach them; integration tests start $(DAEMON) as a real process.
$(TESTS): $(TEST_OBJ) $(TESTLIB_OBJ) $(filter-out $(DAEMON_MAIN),$(DAEMON_OBJ)) $(CONFIG_OBJ) $(RENDER_OBJ) $(CTLTEST_OBJ) $(LIB_A) | $(DAEMON) $(CTL) $(BENCHES)
	$(CC) $(SANFLAGS) -o $@ $(TEST_OBJ) $(TESTLIB_OBJ) $(filter-out $(DAEMON_MAIN),$(DAEMON_OBJ)) $(CONFIG_OBJ) \
	  $(RENDER_OBJ) $(CTLTEST_OBJ) $(LIB_A) $(LIBS_CHECK) $(LIBS_UV) $(LIBS_YAML) $(LIBS_SODIUM) -ldl -lpthread -lm

# DEP_BUILD tells the tests where the binaries are.  The Python suite runs too,
# except under the sanitizers (an ASan library cannot be loaded into python).
check: all $(TESTS) check-includes
	DEP_BUILD=$(abspath $(BUILD)) $(TESTS)
	$(if $(SANFLAGS),,$(PYTEST))

# The parts include one another's headers only through neutral ground (DESIGN
# §2): each part's include path, and its sources' includes (tools/includes.py).
check-includes:
	$(PYTHON) tools/includes.py

# The Python package from the source tree (PYTHONPATH) over this build's library,
# against a daemon its fixture starts from this build.
PYTEST = DEP_BUILD=$(abspath $(BUILD)) DEEPEP_CLIENT_LIB=$(abspath $(BUILD))/$(SONAME) \
	PYTHONPATH=$(abspath python) $(PYTHON) -m pytest -q -p no:cacheprovider python/tests
check-python: all
	$(PYTEST)

# Each tests/rdma/*.sh in one or two QEMU guests with a Soft-RoCE device
# (tests/rdmavm/): the real verbs code on a real (software) RDMA device.
# Needs root; where guests cannot run, each scenario is a SKIP saying why.
check-rdma: all $(TESTS)
	tests/rdmavm/check.sh $(BUILD)

# The GPU-tagged tests, against a daemon on the cuda backend.
check-gpu: all $(TESTS)
	DEP_BUILD=$(abspath $(BUILD)) DEP_TEST_TAGS=gpu DEP_TEST_BACKEND=cuda $(TESTS)

# ASan and UBSan make the suite two to three times slower: Check's timeouts,
# there to catch a hung test, are doubled with it.
asan:
	CK_TIMEOUT_MULTIPLIER=2 $(MAKE) BUILD=build-asan CFLAGS="-O1 -g -fno-omit-frame-pointer" \
	  SANFLAGS="-fsanitize=address,undefined -fno-sanitize-recover=undefined" check

# ThreadSanitizer over the host suites whose daemons and libraries run
# threads (proxy, receiver and worker threads; the library's watch thread):
# any report fails it (tests/tsan.sh).  Host-only (no kernels to build).
# -Wno-tsan: GCC says it cannot model atomic_thread_fence; the three fences
# (stats.c, statrec.c, cuda_ops.c) order memory shared with another process
# or the GPU, which ThreadSanitizer does not watch either way.
TSAN_SUITES ?= xfer xnode xnode_faults xnode_ring multinode multinode_fail peers peer_strangers \
               peer_data server server_proto client ops ops_args link job
tsan:
	$(MAKE) BUILD=build-tsan NVCC=/nonexistent CFLAGS="-O1 -g -fno-omit-frame-pointer -Wno-tsan" \
	  SANFLAGS="-fsanitize=thread" all build-tsan/check_deepepd
	tests/tsan.sh build-tsan $(TSAN_SUITES)

FUZZ_SECONDS ?= 30
FUZZ_CFLAGS := $(CPPFLAGS) $(INC_ALL) -g -O1 -fsanitize=fuzzer,address,undefined
fuzz: $(patsubst tests/fuzz_%.c,$(BUILD)/fuzz/fuzz_%,$(FUZZ_SRC))
	@for f in $^; do n=$$(basename $$f); mkdir -p $(BUILD)/fuzz/$$n.corpus; \
	  echo "fuzz: $$n for $(FUZZ_SECONDS)s"; \
	  $$f -max_total_time=$(FUZZ_SECONDS) -max_len=65536 -print_final_stats=1 \
	     $(BUILD)/fuzz/$$n.corpus tests/corpus/$${n#fuzz_} || exit 1; done
$(BUILD)/fuzz/fuzz_%: tests/fuzz_%.c $(PROTO_SRC) $(CONFIG_SRC)
	@mkdir -p $(@D)
	clang $(FUZZ_CFLAGS) -o $@ $< $(PROTO_SRC) $(CONFIG_SRC) $(LIBS_YAML)

# The fuzz seeds from their fixed messages (tests/corpus_seeds.c), after a
# layout or version change; the proto_fuzz suite's corpus case says when.
.PHONY: corpus
corpus: $(BUILD)/corpus_seeds
	$(BUILD)/corpus_seeds tests/corpus
$(BUILD)/corpus_seeds: tests/corpus_seeds.c tests/corpus_seeds.h $(PROTO_SRC)
	@mkdir -p $(@D)
	$(CC) $(CPPFLAGS) $(INC_ALL) $(CFLAGS) $(WARN) -DDEP_CORPUS_SEEDS_MAIN -o $@ tests/corpus_seeds.c $(PROTO_SRC)

# make deps installs what the goals beside it need: with run (or all) alone,
# what building and running the daemon needs; otherwise, or alone, also what
# the tests, fuzzers, guests and make deb need (.ci/install-deps names each).
DEPS_FOR = $(if $(filter-out deps run all,$(MAKECMDGOALS)),check,$(if $(filter run all,$(MAKECMDGOALS)),run,check))
deps:
	./.ci/install-deps $(DEPS_FOR)

run: all
	@mkdir -p run
	@echo "deepepd: starting in the foreground on ./run/deepepd.sock (host backend)."
	@echo "deepepd: in another shell: $(CTL) -s run/deepepd.sock status"
	exec $(DAEMON) --backend host --socket run/deepepd.sock

# Each exported function (the version script's list) and each function-like
# macro of deepep.h (dep_status) gets a man3 page that is deepep(3), so that
# `man dep_dispatch` and `man dep_status` find it.
EXPORTED = $(shell sed -n 's/^ *\(dep_[a-z0-9_]*\);$$/\1/p' client/libdeepep-client.map)
MAN3_LINKS = $(EXPORTED) $(shell sed -n 's/^\#define \(dep_[a-z0-9_]*\)[^a-z0-9_ ].*/\1/p' include/deepep.h)

install: all
	install -d $(DESTDIR)$(SBINDIR) $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR)/pkgconfig \
	  $(DESTDIR)$(INCLUDEDIR) $(DESTDIR)$(UNITDIR) $(DESTDIR)$(SYSCONFDIR)/deepepd \
	  $(DESTDIR)$(SYSUSERSDIR) $(DESTDIR)$(TMPFILESDIR) \
	  $(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man3 $(DESTDIR)$(MANDIR)/man5 $(DESTDIR)$(MANDIR)/man8
	install -m 0755 $(DAEMON) $(DESTDIR)$(SBINDIR)/deepepd
	install -m 0755 $(CTL) $(DESTDIR)$(BINDIR)/deepepctl
	install -m 0755 $(LIB_SO) $(DESTDIR)$(LIBDIR)/
	ln -sf $(notdir $(LIB_SO)) $(DESTDIR)$(LIBDIR)/$(SONAME)
	ln -sf $(notdir $(LIB_SO)) $(DESTDIR)$(LIBDIR)/libdeepep-client.so
	install -m 0644 $(LIB_A) $(DESTDIR)$(LIBDIR)/
	install -m 0644 include/deepep.h $(DESTDIR)$(INCLUDEDIR)/
	$(PC_SED) client/deepep-client.pc.in > $(DESTDIR)$(LIBDIR)/pkgconfig/deepep-client.pc
	sed -e 's|@SBINDIR@|$(SBINDIR)|g' -e 's|@SYSCONFDIR@|$(SYSCONFDIR)|g' systemd/deepepd.service.in \
	  > $(DESTDIR)$(UNITDIR)/deepepd.service
	install -m 0644 systemd/deepepd.sysusers $(DESTDIR)$(SYSUSERSDIR)/deepepd.conf
	install -m 0644 systemd/deepepd.tmpfiles $(DESTDIR)$(TMPFILESDIR)/deepepd.conf
	test -e $(DESTDIR)$(SYSCONFDIR)/deepepd/deepepd.yaml || \
	  install -m 0644 config/deepepd.yaml $(DESTDIR)$(SYSCONFDIR)/deepepd/deepepd.yaml
	for m in man/*.[1-8]; do [ -e "$$m" ] || continue; \
	  install -m 0644 $$m $(DESTDIR)$(MANDIR)/man$${m##*.}/$${m##*/}; done
	for f in $(MAN3_LINKS); do echo '.so man3/deepep.3' > $(DESTDIR)$(MANDIR)/man3/$$f.3; \
	  chmod 0644 $(DESTDIR)$(MANDIR)/man3/$$f.3; done

# Every file install writes, with the same PREFIX and DESTDIR.  The config is
# removed only where it is still the shipped one: an edited config is the
# operator's, and stays (said on the way).
uninstall:
	rm -f $(DESTDIR)$(SBINDIR)/deepepd $(DESTDIR)$(BINDIR)/deepepctl \
	  $(DESTDIR)$(LIBDIR)/$(notdir $(LIB_SO)) $(DESTDIR)$(LIBDIR)/$(SONAME) \
	  $(DESTDIR)$(LIBDIR)/libdeepep-client.so $(DESTDIR)$(LIBDIR)/$(notdir $(LIB_A)) \
	  $(DESTDIR)$(INCLUDEDIR)/deepep.h $(DESTDIR)$(LIBDIR)/pkgconfig/deepep-client.pc \
	  $(DESTDIR)$(UNITDIR)/deepepd.service $(DESTDIR)$(SYSUSERSDIR)/deepepd.conf \
	  $(DESTDIR)$(TMPFILESDIR)/deepepd.conf
	for m in man/*.[1-8]; do [ -e "$$m" ] || continue; \
	  rm -f $(DESTDIR)$(MANDIR)/man$${m##*.}/$${m##*/}; done
	for f in $(MAN3_LINKS); do rm -f $(DESTDIR)$(MANDIR)/man3/$$f.3; done
	if cmp -s config/deepepd.yaml $(DESTDIR)$(SYSCONFDIR)/deepepd/deepepd.yaml; then \
	  rm -f $(DESTDIR)$(SYSCONFDIR)/deepepd/deepepd.yaml; \
	  rmdir $(DESTDIR)$(SYSCONFDIR)/deepepd 2>/dev/null || true; \
	elif [ -e $(DESTDIR)$(SYSCONFDIR)/deepepd/deepepd.yaml ]; then \
	  echo "uninstall: kept $(DESTDIR)$(SYSCONFDIR)/deepepd/deepepd.yaml: it differs from the shipped config"; fi

# The Debian packages deepepd, libdeepep-client0, libdeepep-client-dev and
# python3-deepep (debian/), built by dpkg-buildpackage from a copy of the
# tree in $(BUILD)/deb/src, so that debhelper's state stays out of the
# checkout; the .debs land in $(BUILD)/deb/.  dpkg-buildpackage names any
# build dependency that is missing (make deps installs them).
DEB_DIR = $(BUILD)/deb
deb:
	@v=$$(dpkg-parsechangelog -S Version); [ "$$v" = "$(VERSION)" ] || \
	  { echo "deb: debian/changelog is at $$v, deepep.h at $(VERSION): add a changelog entry (dch -v $(VERSION))"; exit 1; }
	rm -rf $(DEB_DIR) && mkdir -p $(DEB_DIR)/src
	tar -cf - --exclude-vcs --exclude=./build --exclude='./build-*' --exclude=./$(BUILD) \
	  --exclude=./run --exclude=__pycache__ --exclude='*.egg-info' . | tar -xf - -C $(DEB_DIR)/src
	cd $(DEB_DIR)/src && dpkg-buildpackage -us -uc -b
	rm -rf $(DEB_DIR)/src
	@ls $(DEB_DIR)/*.deb

# The unit as make install writes it, its ExecStart pointed at this build's
# daemon (verify insists the binary exists), held to systemd-analyze verify
# (any line about it fails) and to an exposure ceiling of systemd-analyze
# security: a change that loosens the sandbox past it must raise the ceiling
# here, on purpose.  Where systemd-analyze is absent it skips, saying so.
# (One decimal, as systemd-analyze prints it.)
UNIT_EXPOSURE_MAX := 2.5
verify-unit: $(DAEMON)
	@if ! command -v systemd-analyze >/dev/null 2>&1; then \
	  echo "verify-unit: SKIP: systemd-analyze not found (Debian package systemd)"; exit 0; fi; \
	mkdir -p $(BUILD)/unit && \
	sed -e 's|@SBINDIR@|$(abspath $(BUILD))|g' -e 's|@SYSCONFDIR@|$(SYSCONFDIR)|g' \
	  systemd/deepepd.service.in > $(BUILD)/unit/deepepd.service && \
	out=$$(systemd-analyze verify --man=no $(BUILD)/unit/deepepd.service 2>&1); rc=$$?; \
	if [ $$rc -ne 0 ] || echo "$$out" | grep -q deepepd; then echo "$$out"; \
	  echo "verify-unit: FAIL: systemd-analyze verify rejected systemd/deepepd.service.in"; exit 1; fi; \
	sec=$$(systemd-analyze security --offline=true --no-pager \
	  --threshold=$$(echo $(UNIT_EXPOSURE_MAX) | tr -d .) $(BUILD)/unit/deepepd.service 2>&1); rc=$$?; \
	echo "$$sec" | tail -n 1; \
	if [ $$rc -ne 0 ]; then echo "verify-unit: FAIL: deepepd.service's exposure is over $(UNIT_EXPOSURE_MAX)"; exit 1; fi; \
	echo "verify-unit: deepepd.service OK (systemd-analyze verify; exposure at most $(UNIT_EXPOSURE_MAX))"

# Every man page rendered as a reader gets it, and linted.  mandoc -T lint
# fails on WARNING and above (a date it cannot parse, a bad macro or
# argument, text a formatter would drop); its STYLE notes are accepted: the
# one the pages draw is "input text line longer than 80 bytes", a property
# of the source, which is reflowed when rendered.  man -l (groff through
# man-db, as `man` shows the installed page) must render with no warning.
lint-man:
	@command -v mandoc >/dev/null 2>&1 || \
	  { echo "lint-man: mandoc not found (Debian package mandoc; make deps installs it)"; exit 1; }
	@command -v man >/dev/null 2>&1 || \
	  { echo "lint-man: man not found (Debian package man-db; make deps installs it)"; exit 1; }
	@for m in man/*.[1-8]; do \
	  out=$$(mandoc -T lint -W warning "$$m" 2>&1) || { echo "$$out"; \
	    echo "lint-man: FAIL: mandoc -T lint: $$m"; exit 1; }; \
	  out=$$(MANWIDTH=80 man --warnings -l "$$m" 2>&1 >/dev/null); \
	  [ -z "$$out" ] || { echo "$$out"; echo "lint-man: FAIL: man -l warns about $$m"; exit 1; }; \
	  echo "lint-man: $$m OK"; done

clean:
	rm -rf build build-asan build-tsan

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
