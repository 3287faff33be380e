/*
 * A decode step's decoder layers in one call: a loop over the op records Python lowered from the
 * model's op list, each calling the kernel the torch interpreter calls for that op (layer_ops.c's
 * norms and rotary + KV write, tiled_gemm.c's projections, paged_attention.c's row entry), in
 * the same order on the same data, so the hidden states are bit for bit the interpreter's. What
 * it removes is the Python between them: a step makes about eight calls per layer, and each
 * projection streams its weights through L2 and L3, evicting whatever the Python between two
 * calls had in cache. Opcodes, records and entry points: kernels.h.
 *
 * A kernel that cannot allocate its workspace makes the stack return 1 at once: nothing is
 * half-written that the step keeps, as the caller raises and the step is not committed.
 */
#include <stdlib.h>

#include "kernels.h"

/* the entry point for each dtype: decode_stack_body.h */
#define T float
#define SUFFIX(name) name##_f32
#include "decode_stack_body.h"

#define T uint16_t
#define SUFFIX(name) name##_bf16
#include "decode_stack_body.h"
