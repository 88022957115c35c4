// homespec (WEIGHT_CHUNKS_FIX): how many weight rows a chunk of ggml_compute_forward_mul_mat takes.
// ggml cuts a product into chunks of 16 weight rows (64 for one activation row) that the threads
// take in turn. Over the 1.5B target's output layer (151,936 Q6_K rows of 1,260 bytes) that is
// 9,496 chunks a pass, and with two threads each chunk cost ~0.7 us more than its arithmetic
// (none with one thread): a 4-row product took 13.8 ms in chunks of 16 rows and 7.5-7.7 ms in
// chunks of 256-1,024 (2-core AVX-512 EPYC, scripts/q6k_matmul_cost.c's product, 2026-12-07). So
// a chunk of a quantized weight takes ~256 KiB of it, as long as every thread still gets four
// chunks (ggml's own floor for sharing the work out). Which thread computes a result changes;
// the result does not.
#define HOMESPEC_CHUNK_BYTES ((int64_t) 256 << 10)  // bytes of weight rows a chunk takes at most

static atomic_bool homespec_weight_chunks = true;
GGML_BACKEND_API void homespec_cpu_set_weight_chunks(bool on);
GGML_BACKEND_API void homespec_cpu_set_weight_chunks(bool on) {  // off: ggml's chunks (paired timing)
    atomic_store(&homespec_weight_chunks, on);
}

// Weight rows per chunk for a product over nr0 rows of w on nth threads: ggml's chunk_size, or
// more rows where the weight is quantized (its rows are then the whole of a product's reads).
static int64_t homespec_weight_chunk_rows(const struct ggml_tensor * w, int64_t nr0, int64_t chunk_size, int nth) {
    if (!ggml_is_quantized(w->type) || !atomic_load_explicit(&homespec_weight_chunks, memory_order_relaxed)) {
        return chunk_size;
    }
    const int64_t by_bytes = (HOMESPEC_CHUNK_BYTES + (int64_t) w->nb[1] - 1) / (int64_t) w->nb[1];  // rows
    const int64_t by_threads = (nr0 + 4*nth - 1) / (4*nth);  // rows: four chunks a thread
    // even, as ggml's chunks are: kernels that take two weight rows at a time (ARM's int8 matmul)
    // fall back to one at a time in a chunk of odd length
    return MAX(chunk_size, (MIN(by_bytes, by_threads) + 1) / 2 * 2);
}

