/* The engine's memory: one bump arena over wasm's linear memory, grown on demand.
 * Weights, caches and scratch live as long as the engine (a wasm memory never shrinks), so there is no free;
 * rk_mark / rk_release give back the scratch made since a mark. Called from one thread only. */
#include <stdint.h>

extern unsigned char __heap_base;
static uintptr_t top = 0;

void *rk_alloc(uint32_t bytes) {
  if (!top) top = (uintptr_t)&__heap_base;
  uintptr_t at = (top + 63) & ~(uintptr_t)63;
  uint64_t end = (uint64_t)at + bytes;
  uint64_t have = (uint64_t)__builtin_wasm_memory_size(0) << 16;
  if (end > have) {
    uint64_t pages = (end - have + 65535) >> 16;
    if (__builtin_wasm_memory_grow(0, (uintptr_t)pages) == (uintptr_t)-1) return 0;
  }
  top = (uintptr_t)end;
  return (void *)at;
}

uint32_t rk_mark(void) { return (uint32_t)top; }
void rk_release(uint32_t mark) { top = mark; }
