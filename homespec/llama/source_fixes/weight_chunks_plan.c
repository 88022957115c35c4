    // homespec (WEIGHT_CHUNKS_FIX): chunks of up to ~256 KiB of a quantized weight (homespec_weight_chunk_rows)
    const int64_t chunk_rows0 = homespec_weight_chunk_rows(src0, nr0, chunk_size, nth);
    int64_t nchunk0 = (nr0 + chunk_rows0 - 1) / chunk_rows0;
