// Greedy continuation of prompts given as token ids, printed as token ids: what scripts/serving/
// check_llama_cpp.py compares with transformers' greedy tokens (llama.cpp's own examples print text, and
// text does not tell two tokenisations of the same string apart).
//
//   llama-greedy-ids MODEL.gguf N_NEW [f32] < prompts.txt
//
// `f32` keeps the KV cache in float32 (llama.cpp's default is float16), for an F32 file compared with an
// F32 reference.
// stdin: one prompt per line, token ids separated by spaces. stdout: one line per prompt, the N_NEW
// generated ids (end-of-generation tokens do not stop it, as transformers' generate with
// eos_token_id=None). Each prompt starts from an empty KV cache; the prompt is decoded in one batch, then
// one token per step, as llama-simple does.
#include "llama.h"

#include <clocale>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

static void set_tokens(llama_batch_ext * batch, const llama_token * tokens, int32_t n, llama_pos pos_0) {
    llama_batch_ext_clear(batch);
    for (int32_t i = 0; i < n; ++i) {
        const int32_t   idx = llama_batch_ext_add_token(batch, 0, tokens[i]);
        const llama_pos pos = pos_0 + i;
        llama_batch_ext_set_pos(batch, idx, &pos);
    }
    llama_batch_ext_set_output_logits(batch, n - 1, true);
}

int main(int argc, char ** argv) {
    std::setlocale(LC_NUMERIC, "C");
    if (argc != 3 && !(argc == 4 && std::string(argv[3]) == "f32")) {
        fprintf(stderr, "usage: %s MODEL.gguf N_NEW [f32] < prompts (token ids, one prompt a line)\n", argv[0]);
        return 2;
    }
    const int n_new = std::atoi(argv[2]);
    std::vector<std::vector<llama_token>> prompts;
    size_t longest = 0;
    for (std::string line; std::getline(std::cin, line);) {
        std::istringstream       in(line);
        std::vector<llama_token> ids;
        for (long id; in >> id;) {
            ids.push_back((llama_token) id);
        }
        if (!ids.empty()) {
            longest = ids.size() > longest ? ids.size() : longest;
            prompts.push_back(ids);
        }
    }
    llama_log_set([](ggml_log_level, const char *, void *) {}, nullptr);
    llama_backend_init();
    // The weights as the file lays them out, not repacked for this CPU (`--no-repack` of llama.cpp's tools): the
    // repacked buffers crashed (SIGSEGV) on an Intel Xeon with AVX-512 and AMX under this project's sandbox, for
    // Q8_0 and Q4_K_M files; the file's own layout computes the same greedy tokens everywhere.
    llama_model_params mparams = llama_model_default_params();
    mparams.use_extra_bufts    = false;
    llama_model * model        = llama_model_load_from_file(argv[1], mparams);
    if (model == nullptr) {
        fprintf(stderr, "error: unable to load %s\n", argv[1]);
        return 1;
    }
    llama_context_params cparams = llama_context_default_params();
    cparams.n_ctx                = (uint32_t) (longest + n_new + 1);
    cparams.n_batch              = (uint32_t) (longest + 1);
    if (argc == 4) {
        cparams.type_k = GGML_TYPE_F32;
        cparams.type_v = GGML_TYPE_F32;
    }
    llama_context * ctx          = llama_init_from_model(model, cparams);
    if (ctx == nullptr) {
        fprintf(stderr, "error: failed to create the context\n");
        return 1;
    }
    llama_sampler * smpl = llama_sampler_chain_init(llama_sampler_chain_default_params());
    llama_sampler_chain_add(smpl, llama_sampler_init_greedy());
    llama_batch_ext * batch = llama_batch_ext_init(ctx);
    for (const auto & prompt : prompts) {
        llama_memory_clear(llama_get_memory(ctx), true);
        llama_sampler_reset(smpl);
        set_tokens(batch, prompt.data(), (int32_t) prompt.size(), 0);
        llama_pos pos = 0;
        int32_t   n   = (int32_t) prompt.size();
        for (int i = 0; i < n_new; ++i) {
            if (llama_process(ctx, LLAMA_PROCESS_TYPE_DECODE, batch)) {
                fprintf(stderr, "error: llama_process failed\n");
                return 1;
            }
            pos += n;
            llama_token next = llama_sampler_sample(smpl, ctx, -1);
            printf(i ? " %d" : "%d", next);
            set_tokens(batch, &next, 1, pos);
            n = 1;
        }
        printf("\n");
        fflush(stdout);
    }
    llama_batch_ext_free(batch);
    llama_sampler_free(smpl);
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
