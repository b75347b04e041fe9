/* The graph callback of a non-last stage, in C: llama.cpp calls it for every
 * node of the graph (hundreds per pass), so in Python it cost about 0.6 ms of
 * a 5 ms pass (stages/capture.py). It asks for one node, the last block's
 * output (by name), copies it into a caller's buffer and stops the graph.
 * ggml's functions come in as pointers, so this links against nothing. */
#include <stdbool.h>
#include <stddef.h>
#include <string.h>

typedef const char *(*get_name_fn)(const void *tensor);
typedef size_t (*nbytes_fn)(const void *tensor);
typedef void (*tensor_get_fn)(const void *tensor, void *data, size_t offset, size_t size);

struct specpipe_capture {
    get_name_fn get_name;     /* ggml_get_name */
    nbytes_fn nbytes;         /* ggml_nbytes */
    tensor_get_fn tensor_get; /* ggml_backend_tensor_get */
    char wanted[64];          /* the node to copy out, e.g. "l_out-14" */
    void *buffer;             /* where it goes */
    size_t capacity;          /* bytes the buffer holds */
    size_t captured;          /* bytes copied by the last pass; 0: none yet; (size_t)-1: it did not fit */
};

bool specpipe_capture_node(const void *tensor, bool ask, void *user_data) {
    struct specpipe_capture *capture = user_data;
    bool wanted = strcmp(capture->get_name(tensor), capture->wanted) == 0;
    if (ask) {
        return wanted;
    }
    if (!wanted) {
        return true;
    }
    size_t size = capture->nbytes(tensor);
    if (size > capture->capacity) {
        capture->captured = (size_t)-1;
    } else {
        capture->tensor_get(tensor, capture->buffer, 0, size);
        capture->captured = size;
    }
    return false; /* stop the graph: later nodes (norm, head) are not needed */
}

/* llama.cpp's abort callback: the CPU backend calls it after every graph node
 * and stops the graph when it returns true. The flag is an int another thread
 * sets when the pass running here was cancelled (orchestrator.workers.stage_server). */
bool specpipe_abort_requested(void *flag) {
    return __atomic_load_n((const int *)flag, __ATOMIC_RELAXED) != 0;
}
