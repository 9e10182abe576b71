/* Replacement for mlx-c's half.h on targets without native __fp16/__bf16 C types.
 *
 * mlx-c only declares its float16/bfloat16 item and data accessors when the compiler has
 * arm_fp16.h/arm_bf16.h. Elsewhere we declare them over 16-bit storage types with the same
 * size and bit layout as mlx::core's float16_t/bfloat16_t, which is all the accessors need
 * (they only ever pass these values by pointer). mlx-rs expects exactly these shapes:
 * `float16_t` a struct over u16 and `bfloat16_t` a u16. */
#ifndef MLX_HALF_H
#define MLX_HALF_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define HAS_FLOAT16
typedef struct mlx_float16_storage {
  uint16_t bits;
} float16_t;

#define HAS_BFLOAT16
typedef uint16_t bfloat16_t;

#ifdef __cplusplus
}
#endif

#endif
