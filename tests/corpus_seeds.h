/*
 * corpus_seeds.h — the fuzz harnesses' seed corpora (tests/corpus/frame/,
 * tests/corpus/peer/) as fixed messages, encoded by this build's encoders.
 * Each seed file holds exactly what its entry's build function writes, so
 * a layout or version change shows as a seed that no longer matches (the
 * proto_fuzz suite's corpus case) and `make corpus` writes the seeds anew from
 * the same messages.  A seed the decoders refuse reaches none of them when
 * libFuzzer starts from it: that is what this keeps from happening again.
 */
#ifndef DEP_CORPUS_SEEDS_H
#define DEP_CORPUS_SEEDS_H

#include "proto.h"

/* How a seed is read: what the harness that loads its folder decodes it as. */
enum corpus_seed_kind {
  CORPUS_FRAME,      /* frame/: one control-protocol frame, header and body */
  CORPUS_PEER,       /* peer/: one peer-protocol message */
  CORPUS_PEERS_BODY, /* peer/: a PEERS_OK body without its frame (fuzz_peer.c decodes both) */
  CORPUS_XFER_HDR,   /* frame/: a data connection's frame header (xring.h; fuzz_frame.c decodes
                        both) */
};

struct corpus_seed {
  const char *dir;  /* "frame" or "peer", under tests/corpus/ */
  const char *name; /* the file's name; names starting "unknown_type" must be refused */
  enum corpus_seed_kind kind;
  /* Appends the seed's bytes to b: 0 or the encoder's error. */
  int (*build)(struct proto_buf *b);
};

extern const struct corpus_seed corpus_seeds[];
extern const size_t corpus_nseeds;

/* Whether a seed of this name is one that must be refused as an unknown type. */
int corpus_seed_is_unknown_type(const char *name);

#endif /* DEP_CORPUS_SEEDS_H */
